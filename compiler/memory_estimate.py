"""How much memory and disk a compile will take, from the config and recipe alone.

The estimate is what preflight checks before any weight is read: a compile that cannot fit
is refused in one line naming the estimate and what to change, never ended by the kernel's
OOM killer. It follows the compiler's working set:

- a safetensors directory (pre-quantized ones too: a module's codes at a time) or a GGUF
  file is read a tensor at a time, so the weights cost about the largest tensor (the
  embedding or LM head, in float32, plus its quantization) and one layer (float32, plus
  the lowering's fused copies) — whatever the model's size;
- any other source goes through transformers, which holds the whole model in float32
  plus copies;
- a calibrating pass carries its calibration activations from layer to layer, and its
  statistics (`calibration_bytes`: GPTQ's Hessian, AWQ's Grams);
- the process itself (Python, torch, ONNX Runtime) and a margin for allocator slack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.compiler.checkpoint_ref import CheckpointRef

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe

GIB = 1024**3
PROCESS_BYTES = int(1.2 * GIB)  # interpreter, torch, onnx, onnxruntime, tokenizers
EAGER_BYTES_PER_PARAM = 10.7  # transformers' float32 model, its state dict and the IR's copy
STREAMED_TENSOR_COPIES = 3  # a tensor read in float32, its row chunks' codes and errors
LAYER_COPIES = 3  # a layer's float32 weights, their fused groups, their packed codes
# The passes whose working set calibration_bytes models by name; other calibrating passes
# (gqa_regroup's fit, static KV scales) hold what a KV calibration holds.
CALIBRATION_METHODS = {"gptq": "gptq", "awq": "awq"}


@dataclass(frozen=True)
class Shape:
    """The sizes the estimate needs, from a checkpoint's config."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    # A pre-quantized checkpoint's (bits, group size): its linears stay codes without a pass.
    source_codes: tuple[int, int] | None = None

    @property
    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params


@dataclass(frozen=True)
class CompileEstimate:
    peak_bytes: int
    output_bytes: int
    parts: dict[str, int]  # what the peak is made of, for the refusal message
    # Parts held in turn, not together: the peak counts the larger of these sums.
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def summary(self) -> str:
        alone = [n for n in self.parts if not any(n in ph for ph in self.phases.values())]
        line = ", ".join(self._part(n) for n in alone if self.parts[n] >= 0.05 * GIB)
        if self.phases:
            line += ", then the larger of " + " and ".join(
                f"{phase} ({' + '.join(self._part(n) for n in names)})"
                for phase, names in self.phases.items())
        return line

    def _part(self, name: str) -> str:
        return f"{name} {self.parts[name] / GIB:.1f}"


def read_shape(ref: CheckpointRef) -> Shape | None:
    """The model's sizes from a local config.json, or None when there is none to read."""
    try:
        config = json.loads((Path(ref.location) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return Shape(vocab=int(config["vocab_size"]), hidden=hidden,
                     intermediate=int(config["intermediate_size"]),
                     layers=int(config["num_hidden_layers"]), heads=heads,
                     kv_heads=int(config.get("num_key_value_heads") or heads),
                     head_dim=int(config.get("head_dim") or hidden // heads),
                     tied=bool(config.get("tie_word_embeddings", False)),
                     source_codes=_source_codes(config.get("quantization_config")))
    except (KeyError, TypeError, ValueError):
        return None


def _source_codes(quantization: dict[str, Any] | None) -> tuple[int, int] | None:
    """(bits, group size) of a pre-quantized checkpoint's linears, as near as the config
    says (compressed-tensors keeps them per group of modules: 4 and 128 stand in)."""
    if not quantization:
        return None
    bits = quantization.get("bits") or quantization.get("w_bit") or 4
    group = quantization.get("group_size") or quantization.get("q_group_size") or 128
    return int(bits), int(group) if int(group) > 0 else 128


def streams_weights(ref: CheckpointRef) -> bool:
    """Whether the loader will read this checkpoint a tensor at a time."""
    location = Path(ref.location)
    if ref.gguf_file is not None:
        return gguf_streams(ref.path())
    if not location.is_dir():
        return False
    return (location / "config.json").is_file() and any(location.glob("*.safetensors"))


def gguf_streams(path: Path) -> bool:
    """Whether the loader reads this GGUF file a tensor at a time (compiler/gguf_source.py):
    gguf names its architecture's tensors. Answered from the header, without torch."""
    import gguf

    try:
        field = gguf.GGUFReader(str(path)).fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (OSError, ValueError, KeyError, IndexError):
        return False
    return architecture in gguf.MODEL_ARCH_NAMES.values()


def estimate_compile(recipe: Recipe, ref: CheckpointRef, shape: Shape) -> CompileEstimate:
    """Peak memory and artifact size of compiling `recipe` on a model of `shape`."""
    largest = max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden)
    parts = {"process": PROCESS_BYTES}
    output = _output_bytes(recipe, shape)
    if not streams_weights(ref):  # the whole model stays resident through every phase
        parts["whole model in float32"] = int(EAGER_BYTES_PER_PARAM * shape.params)
        parts |= _calibration_parts(recipe, shape)
        return CompileEstimate(sum(parts.values()), output, parts)
    parts["largest tensor"] = 4 * largest * STREAMED_TENSOR_COPIES
    parts["one layer"] = 4 * shape.layer_params * LAYER_COPIES
    parts |= _calibration_parts(recipe, shape)
    # A streamed compile holds the largest tensor (the head, the lowering's embedding) and the
    # calibration set's layer work at different times, each beside one layer.
    phases = {"weights": ("largest tensor", "one layer")}
    if "calibration" in parts:
        phases["calibration"] = ("one layer", "calibration")
    peak = PROCESS_BYTES + max(sum(parts[n] for n in names) for names in phases.values())
    return CompileEstimate(peak, output, parts, phases)


def _calibration_parts(recipe: Recipe, shape: Shape) -> dict[str, int]:
    methods = [CALIBRATION_METHODS.get(step.name, "kv_cache") for step in recipe.passes
               if calibrates(step.config)]
    if not methods:
        return {}
    config = recipe.calibration
    return {"calibration": max(calibration_bytes(shape, config.samples, config.seq_len, method)
                               for method in methods)}


def calibration_bytes(shape: Shape, samples: int, seq_len: int, method: str,
                      batch_size: int = 8) -> int:
    """Estimated peak bytes a sequential calibration adds to the compile, from the config.

    The largest of its phases (float32 unless said):
      embedding     the embedding table read once, plus the calibration set's hidden states
                    (samples × seq_len × hidden × 4)
      forward       a layer over the set: its inputs and outputs (2 × the hidden states),
                    its weights read once, one batch's attention scores (×3) or MLP
                    activations (×4), whichever is larger, plus the statistics gathered:
                    "gptq" the widest input's Hessian (K × K float64, and its float32
                    products), "awq" every input's Gram in float64, "kv_cache" one
                    window's attention weights
      solve         "gptq" inverting that Hessian: the sum and one copy factored in place
                    (2 × K² × 8) beside the inputs and the weight being quantized; "awq"
                    the Grams with two float32 copies of the widest during the searches
    `method` is "gptq", "awq" or "kv_cache". It grows linearly with samples × seq_len,
    quadratically with the widest linear input, and not with the depth.
    """
    hidden, inter, heads = shape.hidden, shape.intermediate, shape.heads
    q_width, kv_width = heads * shape.head_dim, shape.kv_heads * shape.head_dim
    states = samples * seq_len * hidden * 4
    layer = 4 * (2 * hidden * q_width + 2 * hidden * kv_width + 3 * hidden * inter)
    batch = min(batch_size, samples) * seq_len
    work = 4 * batch * max(3 * heads * seq_len, 4 * inter) + 4 * 4 * batch * hidden
    widest = max(hidden, inter, q_width)
    linear = 4 * 3 * hidden * inter  # the weight, its working copy and its codes
    if method == "gptq":
        gathered, solve = 12 * widest**2, 16 * widest**2 + linear
    elif method == "awq":
        gathered = 8 * (2 * hidden**2 + q_width**2 + inter**2)
        solve = gathered + 8 * widest**2 + linear
    elif method == "kv_cache":
        gathered, solve = 4 * 4 * heads * seq_len**2, 0
    else:
        raise ValueError(f"calibration_bytes: unknown method {method!r}")
    embedding = 4 * shape.vocab * hidden + states
    return max(embedding, 2 * states + layer + work + gathered, states + solve)


def calibrates(config: Any) -> bool:
    needs = getattr(config, "needs_calibration_text", None)
    return bool(needs is not None and needs())


def _output_bytes(recipe: Recipe, shape: Shape) -> int:
    """The artifact's weights: packed codes where a weight pass quantizes, float elsewhere."""
    float_bytes = 4 if recipe.target.weight_dtype == "float32" else 2
    if any(step.name == "rotate" for step in recipe.passes):  # it unties the head
        shape = replace(shape, tied=False)
    weight_pass = next((step.config for step in recipe.passes
                        if getattr(step.config, "bits", None)), None)
    decoder = shape.layers * shape.layer_params
    if weight_pass is not None:  # codes, and a float32 scale per group
        bits, group = weight_pass.bits, getattr(weight_pass, "group_size", 32) or 32
    elif shape.source_codes is not None:  # the checkpoint's own codes, lowered as they are
        bits, group = shape.source_codes
    else:
        return int(decoder * float_bytes + _table_bytes(shape, float_bytes))
    return int(decoder * (bits / 8 + 4 / group) + _table_bytes(shape, float_bytes))


def _table_bytes(shape: Shape, float_bytes: int) -> int:
    """The embedding table and an untied LM head, in float."""
    return shape.vocab * shape.hidden * float_bytes * (1 if shape.tied else 2)


def available_memory() -> int:
    """Bytes this process can still take: MemAvailable, or the cgroup's limit if lower."""
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    available = next(int(line.split()[1]) * 1024 for line in meminfo
                     if line.startswith("MemAvailable:"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available
