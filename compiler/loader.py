"""Load a Hugging Face checkpoint (directory, .gguf file or hub id) into ModelIR."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmopt.compiler.architectures import (
    ACTIVATIONS,
    FAMILIES,
    GLOBAL_NAMES,
    SUPPORTED_ROPE_TYPES,
    ArchFamily,
    UnsupportedModelError,
    family_for,
    is_norm,
)
from llmopt.compiler.checkpoint_ref import (  # noqa: F401 - re-exported: loader's API
    PACKAGE_SCHEME,
    CheckpointNotFoundError,
    CheckpointRef,
    package_file,
    resolve_checkpoint,
)
from llmopt.compiler.gguf_source import gguf_source
from llmopt.compiler.ir import ArchSpec, LayerSpec, ModelIR, RopeSpec
from llmopt.compiler.quant_format import QuantizedLinear
from llmopt.compiler.quantized_checkpoints import read_quantized_checkpoint
from llmopt.compiler.source_tokenizer import (
    TOKENIZER_FILE,
    SourceTokenizer,
    generation_notes,
    read_source_tokenizer,
)
from llmopt.compiler.tokenizer_check import check_tokenizer
from llmopt.compiler.weight_quant import SOURCE_QUANTIZED
from llmopt.compiler.weight_store import (
    SafetensorsSource,
    SourceTensor,
    TensorSource,
    WeightStore,
    index_safetensors,
)

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def load_checkpoint(model: str) -> ModelIR:
    """Read config, weights and tokenizer of `model` into a float32 ModelIR."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = resolve_checkpoint(model)
    try:
        config = AutoConfig.from_pretrained(ref.location, **ref.kwargs())
    except (OSError, ValueError) as exc:
        # A model_type transformers does not know is unsupported, not missing.
        if model_type := _local_model_type(ref):
            family_for(model_type)
        raise CheckpointNotFoundError(f"cannot read model config from {model}: {exc}") from exc
    arch = arch_from_config(config)
    family = family_for(config.model_type)
    tokenizer = load_tokenizer(ref, config)  # before the weights: refusals come fast
    quantized: dict[str, Callable[[], QuantizedLinear]] = {}
    if quantization := getattr(config, "quantization_config", None):
        # AutoModel would need each format's own kernels package: read the tensors ourselves,
        # a module at a time, on access.
        checkpoint = read_quantized_checkpoint(ref.location, dict(quantization))
        state_dict, quantized = ir_source(checkpoint.floats, family, arch), checkpoint.modules
        generation_config = _generation_config(ref.location, config)
    elif (source := safetensors_source(ref, family, arch)) is not None:
        # Read lazily, a tensor at a time, in the checkpoint's dtype until asked for.
        state_dict, generation_config = source, _generation_config(ref.location, config)
    elif ref.gguf_file and (source := gguf_source(ref.path(), family, arch)) is not None:
        # Memory-mapped, a tensor dequantized at a time (as transformers would dequantize it).
        state_dict, generation_config = source, _generation_config(ref.location, config)
    else:
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                ref.location, dtype=torch.float32, **ref.kwargs()
            )
        except NotImplementedError as exc:  # e.g. a GGUF combination transformers lacks
            raise UnsupportedModelError(f"transformers cannot load {model}: {exc}") from exc
        state_dict, generation_config = hf_model.state_dict(), hf_model.generation_config
    weights = (WeightStore(source=state_dict) if isinstance(state_dict, TensorSource)
               else map_weights(state_dict, family, arch))
    _check_eos(arch, generation_config)
    notes = generation_notes(tokenizer.hf, ref.location, ref.gguf_file, generation_config)
    ir = ModelIR(
        arch=_with_generation_eos(arch, generation_config),
        weights=weights,
        source=model,
        tokenizer_files=tokenizer.files,
        tokenizer_spec=tokenizer.spec.model_copy(update={"notes": tokenizer.spec.notes + notes}),
        generation_defaults=generation_defaults(generation_config),
        annotations={"tokens": _special_tokens(tokenizer.hf), "hf_config": config.to_dict()},
    )
    for module, read in quantized.items():
        linear = _ir_name(f"{module}.weight", family).removesuffix(".weight")
        if linear == "lm_head" and arch.tie_word_embeddings:
            raise UnsupportedModelError("unsupported checkpoint: a quantized lm_head with "
                                        "tie_word_embeddings true")
        ir.set_quantized(linear, read)  # its float weight becomes the dequantized codes
        ir.annotations.setdefault(SOURCE_QUANTIZED, []).append(linear)
    return ir


def load_tokenizer(ref: CheckpointRef, config: Any) -> SourceTokenizer:
    """The source's tokenizer as transformers takes it, its spec self-checked against it."""
    from dataclasses import replace

    tokenizer = read_source_tokenizer(ref.location, ref.gguf_file, config)
    report = check_tokenizer(tokenizer.hf, tokenizer.files[TOKENIZER_FILE].decode(),
                             tokenizer.spec)
    spec = tokenizer.spec.model_copy(update={"self_check": report})
    return replace(tokenizer, spec=spec)


def _generation_config(location: str, config: Any) -> Any:
    """What AutoModel would attach: generation_config.json, else derived from the config."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(location)
    except OSError:
        return GenerationConfig.from_model_config(config)


def _local_model_type(ref: CheckpointRef) -> str | None:
    """`model_type` from a local config.json, or None when there is none to read."""
    try:
        return json.loads((Path(ref.location) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def arch_from_config(config: Any) -> ArchSpec:
    """Build the ArchSpec from a transformers config, refusing what we do not implement."""
    family = family_for(config.model_type)
    _check_unsupported(config, family)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ropes = _ropes(config, head_dim)
    layers = tuple(
        LayerSpec(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            sliding_window=_sliding_window(config, layer_type),
            rope=layer_type if layer_type in ropes else "global",
        )
        for layer_type in _layer_types(config)
    )
    is_gemma = family.scale_embeddings
    scalar = getattr(config, "query_pre_attn_scalar", None) if is_gemma else None
    return ArchSpec(
        family=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        layers=layers,
        norm_eps=float(config.rms_norm_eps),
        activation=ACTIVATIONS[_activation_name(config)],
        ropes=ropes,
        max_position=int(config.max_position_embeddings),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        attn_scale=float((scalar or head_dim) ** -0.5),
        embedding_scale=math.sqrt(config.hidden_size) if family.scale_embeddings else None,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        qk_norm=family.qk_norm,
        sandwich_norm=family.sandwich_norm,
        bos_token_id=config.bos_token_id,
        eos_token_ids=_as_ids(config.eos_token_id),
        pad_token_id=config.pad_token_id,
    )


def map_weights(
    state_dict: dict[str, torch.Tensor], family: ArchFamily, arch: ArchSpec
) -> dict[str, torch.Tensor]:
    """Rename HF parameters to IR names; fold Gemma's norm offset; drop a tied LM head."""
    weights: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state_dict.items():
        name = _ir_name(hf_name, family)
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        tensor = tensor.detach().to(torch.float32).contiguous()
        if family.norm_offset and is_norm(name):
            tensor = tensor + family.norm_offset
        weights[name] = tensor
    return weights


def safetensors_source(ref: CheckpointRef, family: ArchFamily,
                       arch: ArchSpec) -> SafetensorsSource | None:
    """A local directory's safetensors as IR weights read on access, or None when the
    directory needs transformers to load it (other formats, renamed or missing tensors)."""
    directory = Path(ref.location)
    files = sorted(directory.glob("*.safetensors")) if ref.gguf_file is None else []
    if not directory.is_dir() or not files:
        return None
    try:
        source = ir_source(index_safetensors(files), family, arch)
    except UnsupportedModelError:
        return None  # let transformers say what it makes of the names
    if not arch.tie_word_embeddings and "lm_head.weight" not in source:
        return None
    return source


def ir_source(stored: dict[str, SourceTensor], family: ArchFamily,
              arch: ArchSpec) -> SafetensorsSource:
    """Checkpoint tensors (by HF name) as IR weights read on access, in the model's order;
    Gemma's norm offset folded, a tied LM head dropped."""
    tensors: dict[str, SourceTensor] = {}
    for key, entry in stored.items():
        name = _ir_name(key, family)
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        offset = family.norm_offset if family.norm_offset and is_norm(name) else 0.0
        tensors[name] = dataclasses.replace(entry, offset=offset)
    return SafetensorsSource(dict(sorted(tensors.items(), key=lambda kv: _model_order(kv[0]))))


# A layer's tensors in the order transformers' modules register them.
_LAYER_ORDER = tuple(f"{p}_proj.{s}" for p in "qkvo" for s in ("weight", "bias")) + (
    "q_norm", "k_norm", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def _model_order(name: str) -> tuple[int, int, int]:
    """The state dict's order (files sort by name): embedding, layers, final norm, head."""
    if name.startswith("layers."):
        index, rest = name.removeprefix("layers.").split(".", 1)
        rank = _LAYER_ORDER.index(rest) if rest in _LAYER_ORDER else len(_LAYER_ORDER)
        return (1, int(index), rank)
    return ({"embed_tokens": 0, "final_norm": 2}.get(name, 3), 0, 0)


def _ir_name(hf_name: str, family: ArchFamily) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    match = _LAYER_KEY.match(hf_name)
    if match and match.group(2) in family.layer_names:
        return f"layers.{match.group(1)}.{family.layer_names[match.group(2)]}"
    raise UnsupportedModelError(f"unsupported checkpoint tensor {hf_name!r}")


def _check_unsupported(config: Any, family: ArchFamily) -> None:
    if _activation_name(config) not in ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activation {_activation_name(config)!r}")
    for flag in family.unsupported_flags:
        if getattr(config, flag, None):
            raise UnsupportedModelError(f"unsupported feature {flag}={getattr(config, flag)!r}")
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise UnsupportedModelError("unsupported feature: mixture of experts")


def _activation_name(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or config.hidden_act


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    # Mistral-style: one sliding window for every layer, when set.
    if getattr(config, "sliding_window", None):
        return ["sliding_attention"] * config.num_hidden_layers
    return ["full_attention"] * config.num_hidden_layers


def _sliding_window(config: Any, layer_type: str) -> int | None:
    if layer_type == "sliding_attention":
        return int(config.sliding_window)
    if layer_type != "full_attention":
        raise UnsupportedModelError(f"unsupported attention layer type {layer_type!r}")
    return None


def _ropes(config: Any, head_dim: int) -> dict[str, RopeSpec]:
    params = config.rope_parameters
    if all(isinstance(v, dict) for v in params.values()):  # one table per layer type (Gemma 3)
        return {lt: _rope(config, p, head_dim, lt) for lt, p in params.items()}
    return {"global": _rope(config, params, head_dim, None)}


def _rope(config: Any, params: dict[str, Any], head_dim: int, layer_type: str | None) -> RopeSpec:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported RoPE type {rope_type!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("unsupported feature: partial rotary embedding")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq, factor = 1.0 / (params["rope_theta"] ** exponents), 1.0
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    return RopeSpec(rope_type, tuple(float(f) for f in inv_freq.float()), float(factor))


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _with_generation_eos(arch: ArchSpec, generation_config: Any) -> ArchSpec:
    from dataclasses import replace

    eos = _as_ids(getattr(generation_config, "eos_token_id", None)) or arch.eos_token_ids
    return replace(arch, eos_token_ids=tuple(dict.fromkeys(eos)))


def _check_eos(arch: ArchSpec, generation_config: Any) -> None:
    for token in _as_ids(getattr(generation_config, "eos_token_id", None)):
        if not 0 <= token < arch.vocab_size:
            raise UnsupportedModelError(f"eos token id {token} outside the vocabulary")


def generation_defaults(generation_config: Any) -> dict[str, Any]:
    """What `generate()` in transformers samples with by default, in SamplingParams' terms:
    the checkpoint's generation config, transformers' global defaults where it is silent
    (top_k 50 when sampling), and only what applies (greedy ignores the warpers but not
    the repetition penalty)."""
    value = _generation_value(generation_config)
    defaults: dict[str, Any] = {"repetition_penalty": float(value("repetition_penalty"))}
    if not value("do_sample"):
        return {"temperature": 0.0, **defaults}
    defaults |= {"temperature": float(value("temperature")), "top_k": int(value("top_k") or 0),
                 "top_p": float(value("top_p"))}
    if value("min_p") is not None:
        defaults["min_p"] = float(value("min_p"))
    if getattr(generation_config, "max_new_tokens", None):
        defaults["max_new_tokens"] = int(generation_config.max_new_tokens)
    return defaults


def _generation_value(generation_config: Any) -> Any:
    """key -> the config's value, else transformers' global default for it."""
    from transformers import GenerationConfig

    global_defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    fallback = global_defaults() if global_defaults else GenerationConfig().to_dict()

    def value(key: str) -> Any:
        own = getattr(generation_config, key, None)
        return own if own is not None else fallback.get(key)

    return value


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    return {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}


__all__ = ["FAMILIES", "arch_from_config", "load_checkpoint", "map_weights", "resolve_checkpoint"]
