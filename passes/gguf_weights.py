"""gguf_weights: keep a GGUF checkpoint's own quantized blocks instead of re-quantizing.

Recipe: `- gguf_weights: {include_lm_head: true}`. The float IR of a GGUF source is
transformers' dequantization of these very blocks, so re-quantizing it to another grid
only adds error (+17-36 % perplexity on SmolLM2's Q4_1 file); this pass is lossless.

  Q4_1  32 weights, fp16 d and m:  w = d*q + m    -> bits 4, zero -m/d (float), asymmetric
  Q4_0  32 weights, fp16 d:        w = d*(q - 8)  -> bits 4, zero 8, symmetric
  Q8_0  32 weights, fp16 d, int8 q: w = d*q       -> bits 8, codes q + 128, zero 128, symmetric
Other types (F32, F16, K-quants) stay float. Each kept tensor is checked against the
IR's float weight before it replaces it.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.quant_format import QuantizedLinear
from llmopt.compiler.weight_quant import float_weight, quantization_report, target_linears
from llmopt.passes.registry import PassContext, PassResult

GROUP = 32  # every supported type's block length
# GGUF linear name -> IR linear name, per layer.
LAYER_LINEARS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                 "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                 "ffn_down": "down_proj"}
# llama.cpp's converter interleaves the rotary halves of Q and K rows for these
# `general.architecture`s; transformers' GGUF loader undoes it (LlamaTensorProcessor).
PERMUTED_QK = {"llama"}
# Largest |dequantized - IR weight| allowed, relative to the tensor's largest |weight|:
# only float rounding ((q - (-m/d)) * d against d*q + m) may separate them.
MAX_RELATIVE_DIFF = 1e-6


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Off by default, as for the other passes: ONNX Runtime's 8-bit MatMulNBits is fast only
    # at target.nbits_accuracy_level 4 (SmolLM2's Q8_0 head: 1.3 ms there, 98 ms at level 0,
    # 3.9 ms as the float Gemm).
    include_lm_head: bool = False
    skip: list[str] = Field(default_factory=list)  # glob patterns of IR linear names


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    import gguf

    started = time.perf_counter()
    path = gguf_path(ir.source)
    reader = gguf.GGUFReader(path)
    architecture = _field_string(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    names = gguf_names(ir.arch.num_layers, ir.arch.tie_word_embeddings)
    out = ir.copy()
    errors, diffs, kept, left_float = {}, {}, {}, {}
    for linear in target_linears(ir, config):
        tensor = tensors.get(names[linear])
        kind = tensor.tensor_type.name if tensor is not None else "absent"
        if kind not in DECODERS:
            left_float[linear] = kind
            continue
        q = DECODERS[kind](np.asarray(tensor.data))
        if architecture in PERMUTED_QK and linear.endswith(("q_proj", "k_proj")):
            layer = ir.arch.layers[int(linear.split(".")[1])]
            heads = layer.num_heads if linear.endswith("q_proj") else layer.num_kv_heads
            q = permute_rows(q, unpermute_qk_rows(q.shape[0], heads))
        w, dequantized = float_weight(ir, linear), q.dequantize()
        diffs[linear] = check_equal(names[linear], dequantized, w)
        errors[linear] = float((dequantized - w).norm() / w.norm())
        kept[kind] = kept.get(kind, 0) + 1
        out.set_quantized(linear, q)
    report = quantization_report(ir, out, errors, time.perf_counter() - started, context)
    report.update(
        gguf_file=path, architecture=architecture,
        file_tensor_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        kept_quantized=kept, left_float=left_float,
        max_dequant_diff=max(diffs.values(), default=0.0),
    )
    return PassResult(out, report)


def gguf_path(source: str) -> str:
    """The GGUF file an IR was loaded from; any other source is an error."""
    from pathlib import Path

    from llmopt.compiler.loader import resolve_checkpoint

    ref = resolve_checkpoint(source)
    if ref.gguf_file is None:
        raise ValueError(f"pass 'gguf_weights' needs a .gguf checkpoint, but model {source!r} is "
                         f"not one (use rtn/gptq/awq to quantize it)")
    return str(Path(ref.location) / ref.gguf_file)


def gguf_names(num_layers: int, tied: bool) -> dict[str, str]:
    """IR linear name -> GGUF tensor name (the tied LM head is the token embedding)."""
    names = {f"layers.{i}.{ir}": f"blk.{i}.{g}.weight"
             for i in range(num_layers) for g, ir in LAYER_LINEARS.items()}
    names["lm_head"] = "token_embd.weight" if tied else "output.weight"
    return names


# --- block decoding: raw GGUF rows [N, blocks * bytes] -> QuantizedLinear -----------------
def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    return data.reshape(data.shape[0], -1, block_bytes)


def _fp16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, as float32 [N, G]."""
    field = np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(field.astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[N, G, 16] bytes -> codes [N, G * 32]: byte j holds weight j (low) and j + 16 (high)."""
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return torch.from_numpy(codes.reshape(qs.shape[0], -1))


def decode_q4_0(data: np.ndarray) -> QuantizedLinear:
    blocks = _blocks(data, 18)
    scales = _fp16(blocks, 0)
    return QuantizedLinear(4, GROUP, _nibbles(blocks[..., 2:]), scales,
                           torch.full_like(scales, 8.0), symmetric=True)


def decode_q4_1(data: np.ndarray) -> QuantizedLinear:
    blocks = _blocks(data, 20)
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    codes = _nibbles(blocks[..., 4:])
    # A block with d = 0 holds m everywhere: write it as codes 0, scale m, zero -1.
    flat = d == 0
    if flat.any():
        codes = codes.reshape(*d.shape, GROUP).masked_fill(flat[..., None], 0).flatten(1)
    scales = torch.where(flat, m, d)
    zeros = torch.where(flat, torch.full_like(d, -1.0), -m / torch.where(flat, 1.0, d))
    return QuantizedLinear(4, GROUP, codes, scales, zeros, symmetric=False)


def decode_q8_0(data: np.ndarray) -> QuantizedLinear:
    blocks = _blocks(data, 34)
    scales = _fp16(blocks, 0)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.int16) + 128
    codes = torch.from_numpy(q.astype(np.uint8).reshape(blocks.shape[0], -1))
    return QuantizedLinear(8, GROUP, codes, scales, torch.full_like(scales, 128.0),
                           symmetric=True)


DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q8_0": decode_q8_0}


# --- layout and verification ---------------------------------------------------------------
def unpermute_qk_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: IR row r is GGUF row perm[r]
    (transformers' `_reverse_permute_weights` applied to row indices)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def permute_rows(q: QuantizedLinear, perm: torch.Tensor) -> QuantizedLinear:
    """Reorder output rows: codes, scales and zeros move together, so it stays exact."""
    return QuantizedLinear(q.bits, q.group_size, q.codes[perm], q.scales[perm], q.zeros[perm],
                           q.symmetric)


def check_equal(name: str, dequantized: torch.Tensor, weight: torch.Tensor) -> float:
    """Largest |dequantized - weight|; raises unless only float rounding separates them."""
    if dequantized.shape != weight.shape:
        raise ValueError(f"gguf_weights: {name} is {tuple(dequantized.shape)} in the GGUF file "
                         f"but {tuple(weight.shape)} in the IR")
    diff = float((dequantized - weight).abs().max())
    scale = float(weight.abs().max())
    if diff > MAX_RELATIVE_DIFF * scale:
        raise ValueError(f"gguf_weights: {name}'s dequantized blocks differ from the IR weight by "
                         f"{diff:.3g} (largest |w| {scale:.3g}): not the weights the IR holds")
    return diff


def _field_string(reader: Any, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()
