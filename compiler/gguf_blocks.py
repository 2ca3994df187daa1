"""GGUF's quantized blocks as QuantizedLinear, beside the other pre-quantized formats
(`quantized_checkpoints`): the block layouts, llama.cpp's Q/K row order, and the check
that decoded blocks are the weights the IR holds.

  Q4_1  32 weights, fp16 d and m:  w = d*q + m    -> bits 4, zero -m/d (float), asymmetric
  Q4_0  32 weights, fp16 d:        w = d*(q - 8)  -> bits 4, zero 8, symmetric
  Q8_0  32 weights, fp16 d, int8 q: w = d*q       -> bits 8, codes q + 128, zero 128, symmetric
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmopt.compiler.quant_format import QuantizedLinear

GROUP = 32  # every supported type's block length
# Largest |dequantized - IR weight| allowed, relative to the tensor's largest |weight|:
# only float rounding ((q - (-m/d)) * d against d*q + m) may separate them.
MAX_RELATIVE_DIFF = 1e-6


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


def field_string(reader: Any, key: str) -> str:
    """A string field of a `gguf.GGUFReader`'s metadata."""
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()
