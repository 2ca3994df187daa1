"""How much memory and disk a compile will take, from the config and recipe alone.

The estimate is what preflight checks before any weight is read: a compile that cannot fit
is refused in one line naming the estimate and what to change, never ended by the kernel's
OOM killer. It follows the compiler's working set:

- a safetensors directory is read a tensor at a time, so the weights cost about the
  largest tensor (the embedding or LM head, in float32, plus its quantization) and one
  layer (float32, plus the lowering's fused copies) — whatever the model's size;
- any other source (a GGUF file, a pre-quantized checkpoint) goes through transformers,
  which holds the whole model in float32 plus copies;
- a calibrating pass carries its calibration activations from layer to layer, and GPTQ
  one Hessian of the widest input;
- the process itself (Python, torch, ONNX Runtime) and a margin for allocator slack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
ACTIVATION_COPIES = 4  # a layer's input, output, residual and the pass's own buffers


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

    def summary(self) -> str:
        return ", ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items()
                         if size >= 0.05 * GIB)


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
                     tied=bool(config.get("tie_word_embeddings", False)))
    except (KeyError, TypeError, ValueError):
        return None


def streams_weights(ref: CheckpointRef) -> bool:
    """Whether the loader will read this checkpoint a tensor at a time."""
    location = Path(ref.location)
    if ref.gguf_file is not None or not location.is_dir():
        return False
    try:
        config = json.loads((location / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "quantization_config" not in config and any(location.glob("*.safetensors"))


def estimate_compile(recipe: Recipe, ref: CheckpointRef, shape: Shape) -> CompileEstimate:
    """Peak memory and artifact size of compiling `recipe` on a model of `shape`."""
    largest = max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden)
    parts = {"process": PROCESS_BYTES}
    if streams_weights(ref):
        parts["largest tensor"] = 4 * largest * STREAMED_TENSOR_COPIES
        parts["one layer"] = 4 * shape.layer_params * LAYER_COPIES
    else:
        parts["whole model in float32"] = int(EAGER_BYTES_PER_PARAM * shape.params)
    parts |= _calibration_parts(recipe, shape)
    return CompileEstimate(sum(parts.values()), _output_bytes(recipe, shape), parts)


def _calibration_parts(recipe: Recipe, shape: Shape) -> dict[str, int]:
    calibrating = [step for step in recipe.passes if calibrates(step.config)]
    if not calibrating:
        return {}
    tokens = recipe.calibration.samples * recipe.calibration.seq_len
    parts = {"calibration activations": 4 * tokens * shape.hidden * ACTIVATION_COPIES}
    if any(step.name == "gptq" for step in calibrating):
        parts["GPTQ Hessian"] = 2 * 4 * shape.intermediate**2  # the matrix and its inverse
    return parts


def calibrates(config: Any) -> bool:
    needs = getattr(config, "needs_calibration_text", None)
    return bool(needs is not None and needs())


def _output_bytes(recipe: Recipe, shape: Shape) -> int:
    """The artifact's weights: packed codes where a weight pass quantizes, float elsewhere."""
    float_bytes = 4 if recipe.target.weight_dtype == "float32" else 2
    weight_pass = next((step.config for step in recipe.passes
                        if getattr(step.config, "bits", None)), None)
    decoder = shape.layers * shape.layer_params
    if weight_pass is None:
        decoder_bytes = decoder * float_bytes
    else:  # codes, and a float32 scale per group
        group = getattr(weight_pass, "group_size", 32) or 32
        decoder_bytes = decoder * (weight_pass.bits / 8 + 4 / group)
    table = shape.vocab * shape.hidden * float_bytes * (1 if shape.tied else 2)
    return int(decoder_bytes + table)


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
