"""Write a ModelIR as a Hugging Face checkpoint directory, its quantized linears packed in
a format transformers, vLLM and our own loader read: compressed-tensors `pack-quantized`
(the default; transformers needs the `compressed-tensors` package), GPTQ v1 or v2, or
AutoAWQ GEMM — or `float`: every linear dequantized, a plain checkpoint any tool loads.
Float tensors are written as float32, as the IR holds them.

The IR comes from a recipe (its passes re-run) or from a compiled artifact
(`artifact_reader`: the graph's own weights, seconds).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from llmopt.compiler.architectures import GLOBAL_NAMES, ArchFamily, family_for, is_norm
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.quant_format import QuantizedLinear
from llmopt.compiler.quantized_checkpoints import to_awq, to_compressed, to_gptq
from llmopt.compiler.recipe import Recipe

Packer = Callable[[QuantizedLinear, str], dict[str, torch.Tensor]]
PACKERS: dict[str, Packer] = {
    "compressed-tensors": to_compressed,
    "gptq": lambda q, name: to_gptq(q, name, version=1),
    "gptq_v2": lambda q, name: to_gptq(q, name, version=2),
    "awq": to_awq,
}
FLOAT_FORMAT = "float"  # quantized linears written dequantized, no quantization_config
EXPORT_FORMATS = (*PACKERS, FLOAT_FORMAT)
SINGLE_FILE = "model.safetensors"
# Tensors held before a shard is written: bounds an export's memory whatever the model's
# size (transformers' save_pretrained shards at 5 GB for the same reason).
SHARD_BYTES = 2 << 30


def export_hf(ir: ModelIR, out: Path, fmt: str = "compressed-tensors") -> None:
    """Write `ir` to the (new) directory `out`: config, safetensors shards, tokenizer. One
    shard's tensors are in memory at a time (SHARD_BYTES)."""
    from llmopt.compiler.artifact import staging_directory

    check_format(fmt)
    if "hf_config" not in ir.annotations:
        raise ValueError("export needs an IR loaded from a Hugging Face config")
    if fmt == FLOAT_FORMAT:  # the float weights already equal the dequantized codes
        ir = dataclasses.replace(ir, quantized={})
    config = {**ir.annotations["hf_config"], "dtype": "float32",
              "num_key_value_heads": _uniform_kv_heads(ir)}
    for build_only in ("torch_dtype", "quantization_config", "_name_or_path"):
        config.pop(build_only, None)  # _name_or_path: a path on the build machine
    config["architectures"] = config.get("architectures") or [_causal_lm_class(config)]
    if "lm_head" in ir.quantized and ir.arch.tie_word_embeddings:
        config["tie_word_embeddings"] = False  # embed_tokens holds the dequantized head
    schemes = hf_schemes(ir)
    if schemes:
        config["quantization_config"] = quantization_config(fmt, schemes, _float_linears(ir))
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; not replacing it")
    with staging_directory(out) as staging:
        write_shards(hf_tensors(ir, fmt), staging)
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", _generation_config(ir))
        _write_tokenizer(ir, staging)
        for file in staging.iterdir():
            file.chmod(0o644)  # a checkpoint is meant to be shared, whatever wrote it


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], directory: Path) -> None:
    """`model.safetensors`, or shards of about SHARD_BYTES and their index, the layout
    transformers' `save_pretrained` writes."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []  # each written shard's tensor names
    total = pending = 0  # bytes of every tensor, and of the shard being filled
    for name, tensor in tensors:
        if shard and pending + tensor.nbytes > SHARD_BYTES:
            names.append(_save_shard(shard, directory, len(names)))
            shard, pending = {}, 0
        shard[name] = tensor
        total, pending = total + tensor.nbytes, pending + tensor.nbytes
    if not names:
        save_file(shard, directory / SINGLE_FILE, metadata={"format": "pt"})
        return
    names.append(_save_shard(shard, directory, len(names)))
    _index_shards(directory, names, total)


def _save_shard(shard: dict[str, torch.Tensor], directory: Path, number: int) -> list[str]:
    from safetensors.torch import save_file

    save_file(shard, directory / f".shard-{number}", metadata={"format": "pt"})
    return list(shard)


def _index_shards(directory: Path, names: list[list[str]], total_bytes: int) -> None:
    """Name the shards once their count is known; write the index of where each tensor is."""
    weight_map = {}
    for number, shard in enumerate(names, start=1):
        final = directory / f"model-{number:05d}-of-{len(names):05d}.safetensors"
        (directory / f".shard-{number - 1}").rename(final)
        weight_map |= dict.fromkeys(shard, final.name)
    _write_json(directory / f"{SINGLE_FILE}.index.json",
                {"metadata": {"total_size": total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))})


def export_recipe(recipe: Recipe, out: Path, fmt: str,
                  log: Callable[[str], None] = print) -> None:
    """Load the recipe's model, run its passes, write `out` as a HF checkpoint in `fmt`."""
    from llmopt.compiler.loader import load_checkpoint
    from llmopt.compiler.pipeline import check_pass_order, run_passes, scratch_directory

    check_pass_order(recipe)
    check_format(fmt)
    log(f"[1/3] loading {recipe.model}")
    ir = load_checkpoint(recipe.model)
    check_groups_fit(ir, recipe)
    with scratch_directory(Path(out)) as scratch:
        ir.quantized.spill_dir = scratch  # integer weights wait on disk, as in a compile
        ir, _ = run_passes(ir, recipe, log)
        log(f"[3/3] writing a {fmt} Hugging Face checkpoint to {out}")
        export_hf(ir, out, fmt)


def _uniform_kv_heads(ir: ModelIR) -> int:
    """A Hugging Face config holds one KV head count for every layer."""
    heads = sorted({layer.num_kv_heads for layer in ir.arch.layers})
    if len(heads) != 1:
        raise ValueError(f"cannot export layers with different KV head counts {heads} as a "
                         "Hugging Face checkpoint (its config holds one)")
    return heads[0]


def _causal_lm_class(config: dict[str, Any]) -> str:
    """transformers' causal-LM class for the config (vLLM dispatches on `architectures`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]


def export_artifact(artifact: Path, out: Path, fmt: str,
                    log: Callable[[str], None] = print) -> None:
    """Write the compiled artifact's target model as a HF checkpoint in `fmt`, from the
    graph's own (quantized) weights: no pass runs again."""
    from llmopt.compiler.artifact_reader import read_artifact

    check_format(fmt)
    log(f"[1/2] reading the compiled weights of {artifact}")
    ir = read_artifact(artifact)
    log(f"[2/2] writing a {fmt} Hugging Face checkpoint to {out}")
    export_hf(ir, out, fmt)


def loading_hint(out: Path, fmt: str) -> str:
    """How transformers loads what `export_hf` wrote in `fmt` (one line)."""
    config = json.loads((Path(out) / "config.json").read_text())
    quantization = config.get("quantization_config")
    load = f"AutoModelForCausalLM.from_pretrained({str(out)!r}"
    if quantization is None:
        return f"load with {load}) (plain float weights)"
    if fmt == "compressed-tensors":
        groups = quantization["config_groups"].values()
        if all(g["weights"]["symmetric"] for g in groups):
            return f"load with {load}) (needs the compressed-tensors package)"
        return (f"load with {load}, quantization_config=CompressedTensorsConfig(dequantize="
                "True)): compressed-tensors 0.20 refuses packed asymmetric zero points "
                "otherwise; --format float writes plain float weights")
    kernels = "gptqmodel" if fmt.startswith("gptq") else "autoawq"
    return f"load with {load}) (needs the {kernels} package; or vLLM)"


def check_format(fmt: str) -> None:
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(EXPORT_FORMATS)})")


def check_groups_fit(ir: ModelIR, recipe: Recipe) -> None:
    """Every format stores whole groups only: refuse before a pass spends minutes."""
    widths = {ir.arch.hidden_size, ir.arch.intermediate_size}
    widths |= {layer.num_heads * layer.head_dim for layer in ir.arch.layers}
    for name, config in recipe.passes:
        group_size = getattr(config, "group_size", None)
        if group_size and any(w % group_size for w in widths):
            raise ValueError(
                f"pass {name!r}: group_size {group_size} does not divide the linear input "
                f"widths {sorted(widths)}; Hugging Face formats store whole groups only")


def hf_tensors(ir: ModelIR, fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors to save, one linear or weight at a time."""
    family = family_for(ir.arch.family)
    for linear in ir.quantized:
        module = _hf_module(linear, family)
        try:
            packed = PACKERS[fmt](ir.quantized[linear], module)
        except ValueError as exc:
            raise ValueError(f"cannot export as {fmt}: {exc}; --format float writes every "
                             "linear dequantized") from None
        yield from ((f"{module}.{suffix}", t) for suffix, t in packed.items())
    for name in ir.weights:
        if name.removesuffix(".weight") in ir.quantized:
            continue  # `embed_tokens` stays float even when the (tied) head is quantized
        tensor = ir.weights[name]
        if family.norm_offset and is_norm(name):
            tensor = tensor - family.norm_offset  # Gemma stores w, multiplies by 1 + w
        yield _hf_name(name, family), tensor.float().contiguous()


def hf_schemes(ir: ModelIR) -> dict[str, tuple[int, int, bool]]:
    """(bits, group size, symmetric) of each quantized linear by HF module name, from the
    store's headers (no codes read)."""
    family = family_for(ir.arch.family)
    return {_hf_module(linear, family): ir.quantized.scheme(linear) for linear in ir.quantized}


def _hf_module(linear: str, family: ArchFamily) -> str:
    return _hf_name(f"{linear}.weight", family).removesuffix(".weight")


def quantization_config(fmt: str, schemes: dict[str, tuple[int, int, bool]],
                        float_linears: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for `fmt`; GPTQ and AWQ take one scheme."""
    if fmt == "compressed-tensors":
        return _compressed_config(schemes, float_linears)
    distinct = set(schemes.values())
    if len(distinct) != 1:
        raise ValueError(f"{fmt} needs one bits/group size/symmetry for every linear, got "
                         f"{sorted(distinct)}; export compressed-tensors")
    ((bits, group_size, symmetric),) = distinct
    if fmt == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": bits, "group_size": group_size,
                "zero_point": True, "modules_to_not_convert": float_linears}
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": symmetric,
            "desc_act": False, "static_groups": False, "true_sequential": True,
            "lm_head": any(m == "lm_head" for m in schemes), "format": fmt,
            "checkpoint_format": fmt}


def _compressed_config(modules: dict[str, tuple[int, int, bool]],
                       float_linears: list[str]) -> dict[str, Any]:
    """One config group per scheme, targeting its modules by exact name."""
    schemes: dict[tuple[int, int, bool], list[str]] = {}
    for module, scheme in modules.items():
        schemes.setdefault(scheme, []).append(module)
    groups = {
        f"group_{i}": {
            "targets": targets, "input_activations": None, "output_activations": None,
            "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                        "strategy": "group", "group_size": group_size, "dynamic": False,
                        "actorder": None, "observer": "minmax"},
        }
        for i, ((bits, group_size, symmetric), targets) in enumerate(schemes.items())
    }
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "config_groups": groups,
            "ignore": float_linears, "kv_cache_scheme": None, "sparsity_config": {}}


def _hf_name(name: str, family: ArchFamily) -> str:
    """IR weight name -> HF parameter name: the loader's tables, inverted."""
    for hf, ir in GLOBAL_NAMES.items():
        if ir == name:
            return hf
    _, index, rest = name.split(".", 2)
    for hf, ir in family.layer_names.items():
        if ir == rest:
            return f"model.layers.{index}.{hf}"
    raise ValueError(f"IR weight {name!r} has no Hugging Face name")


def _float_linears(ir: ModelIR) -> list[str]:
    """HF names of the linears left float (for `ignore` / `modules_to_not_convert`)."""
    family = family_for(ir.arch.family)
    linears = [n.removesuffix(".weight") for n in ir.weights
               if n.endswith("_proj.weight") and n.removesuffix(".weight") not in ir.quantized]
    names = [_hf_name(f"{n}.weight", family).removesuffix(".weight") for n in linears]
    return names + ([] if "lm_head" in ir.quantized else ["lm_head"])


def _generation_config(ir: ModelIR) -> dict[str, Any]:
    arch = ir.arch
    config = {"bos_token_id": arch.bos_token_id, "eos_token_id": list(arch.eos_token_ids),
              "pad_token_id": arch.pad_token_id}
    if ir.generation_defaults.get("temperature", 0.0) > 0:
        config |= {"do_sample": True, **ir.generation_defaults}
    return config


def _write_tokenizer(ir: ModelIR, directory: Path) -> None:
    if "tokenizer.json" not in ir.tokenizer_files:
        return
    for name, content in ir.tokenizer_files.items():
        (directory / name).write_bytes(content)
    tokens = {k: v for k, v in ir.annotations.get("tokens", {}).items() if v is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    if spec := ir.tokenizer_spec:  # what transformers added around text on the source
        config |= {"add_bos_token": spec.add_bos_token, "add_eos_token": spec.add_eos_token}
    if ir.chat_template:
        config["chat_template"] = ir.chat_template
    _write_json(directory / "tokenizer_config.json", config)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
