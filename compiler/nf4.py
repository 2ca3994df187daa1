"""Code-book 4-bit weights (bitsandbytes' NF4 and FP4): the offline transform, the
bitsandbytes checkpoint layout, and how the graph consumes them — side by side.

A code-book linear w [N, K] has 4-bit codes c, a 16-value code book C and one float
absmax per block of `group_size` inputs: w = C[c] * absmax (a QuantizedLinear whose
`codebook` is set; its zeros are 0). bitsandbytes cuts the *flattened* weight into
blocks, which are rows' groups when the block size divides K (the only case read here),
and packs two codes a byte, the first in the high nibble. With double quantization the
absmax values are themselves 8-bit codes: absmax = map2[q] * nested_absmax[b / 256] +
offset (float32), which is what we keep as scales.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from llmopt.compiler.architectures import UnsupportedModelError
from llmopt.compiler.quant_format import QuantizedLinear, expand_groups, group_view

# bitsandbytes' get_4bit_type tables: NF4 (normal quantiles) and FP4 (e2m1, / 12).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float32)
FP4_CODE = torch.tensor([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
                         -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]) / 12.0
NESTED_BLOCK = 256  # bitsandbytes' block of absmax values under double quantization
_STATE = "weight.quant_state.bitsandbytes__"
BNB_TENSORS = ("weight.absmax", "weight", "weight.quant_map", "weight.nested_absmax",
               "weight.nested_quant_map", f"{_STATE}nf4", f"{_STATE}fp4")


# --- the offline transform -----------------------------------------------------------------
def codebook_quantize(w: torch.Tensor, group_size: int, code: torch.Tensor = NF4_CODE,
                      double_quant: bool = False, clip: torch.Tensor | None = None
                      ) -> QuantizedLinear:
    """Round-to-nearest code-book quantization of w [N, K]: each block scaled by its absmax,
    each value to the nearest code (bitsandbytes' rule); `double_quant` rounds the absmax
    values to 8-bit codes in blocks of 256 around their mean, as bitsandbytes stores them;
    `clip` [N, G] shrinks each block's absmax (AWQ's clipping search)."""
    w = w.float()
    n, k = w.shape
    absmax = group_view(w, group_size).abs().amax(dim=-1)  # [N, G]
    if clip is not None:
        absmax = absmax * clip
    absmax = absmax.clamp(min=1e-12)
    if double_quant:
        absmax = _double_quantized(absmax)
    scaled = (w / expand_groups(absmax, group_size, k)).clamp(-1, 1)
    codes = nearest_codes(scaled, code)
    return QuantizedLinear(4, group_size, codes, absmax, torch.zeros_like(absmax), True,
                           codebook=code.clone())


def nearest_codes(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code-book value for each of `scaled` (midpoints, ties up)."""
    order = torch.argsort(code)
    ordered = code[order]
    bounds = (ordered[:-1] + ordered[1:]) / 2
    return order[torch.bucketize(scaled, bounds)].to(torch.uint8)


def _double_quantized(absmax: torch.Tensor) -> torch.Tensor:
    """absmax after bitsandbytes-style double quantization: mean offset, 8-bit blockwise
    codes on a signed linear map, dequantized (what the runtime reads)."""
    flat = absmax.flatten()
    offset = flat.mean()
    centred = flat - offset
    pad = -flat.numel() % NESTED_BLOCK
    blocks = torch.nn.functional.pad(centred, (0, pad)).reshape(-1, NESTED_BLOCK)
    nested = blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    grid = torch.linspace(-1, 1, 256)
    codes = nearest_codes((blocks / nested).clamp(-1, 1), grid)
    back = (grid[codes.long()] * nested).flatten()[:flat.numel()] + offset
    return back.reshape(absmax.shape)


# --- reading a bitsandbytes 4-bit checkpoint ----------------------------------------------
def check_bnb_config(config: dict[str, Any]) -> None:
    """Refuse, in one line, every bitsandbytes variant this reader does not take."""
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    storage = str(config.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if config.get("load_in_8bit") or not config.get("load_in_4bit"):
        what = "8-bit (LLM.int8) weights" if config.get("load_in_8bit") else "no load_in_4bit"
        raise UnsupportedModelError(
            f"unsupported bitsandbytes checkpoint: {what} (supported: 4-bit nf4 or fp4)")
    if quant_type not in ("nf4", "fp4") or storage != "uint8":
        raise UnsupportedModelError(
            f"unsupported bitsandbytes checkpoint: bnb_4bit_quant_type {quant_type!r}, "
            f"quant_storage {storage!r} (supported: nf4 or fp4 in uint8)")


def from_bnb(t: dict[str, torch.Tensor], name: str) -> QuantizedLinear:
    """One Linear4bit's serialized state (names without the module prefix) as a code-book
    linear, dequantizing a double-quantized absmax as bitsandbytes does."""
    state_key = next((k for k in t if k.startswith(_STATE)), None)
    if state_key is None or "weight" not in t or "weight.quant_map" not in t:
        raise UnsupportedModelError(f"{name}: bitsandbytes 4-bit state is incomplete "
                                    f"(has {sorted(t)})")
    state = json.loads(bytes(t[state_key].to(torch.uint8).tolist()).decode())
    n, k = (int(d) for d in state["shape"])
    block = int(state["blocksize"])
    if k % block:
        raise UnsupportedModelError(f"{name}: bitsandbytes block size {block} does not divide "
                                    f"the input width {k} (blocks would span rows)")
    absmax = t["weight.absmax"]
    if "weight.nested_absmax" in t:
        absmax = _nested_absmax(absmax, t["weight.nested_absmax"], t["weight.nested_quant_map"],
                                int(state.get("nested_blocksize", NESTED_BLOCK)),
                                float(state["nested_offset"]))
    code = t["weight.quant_map"].float().flatten()
    if code.numel() != 16:
        raise UnsupportedModelError(f"{name}: a 4-bit quant_map has 16 values, not {code.numel()}")
    codes = unpack_bnb(t["weight"], n * k).reshape(n, k)
    scales = absmax.float().reshape(n, k // block)
    return QuantizedLinear(4, block, codes, scales.contiguous(), torch.zeros_like(scales), True,
                           codebook=code.contiguous())


def _nested_absmax(codes: torch.Tensor, nested: torch.Tensor, code_map: torch.Tensor,
                   block: int, offset: float) -> torch.Tensor:
    """bitsandbytes' dequantize_blockwise of the absmax codes, then + offset (float32)."""
    values = code_map.float()[codes.flatten().long()]
    pad = -values.numel() % block
    blocks = torch.nn.functional.pad(values, (0, pad)).reshape(-1, block)
    out = (blocks * nested.float().reshape(-1, 1)).flatten()[:codes.numel()]
    return out + torch.tensor(offset, dtype=torch.float32)


def unpack_bnb(packed: torch.Tensor, count: int) -> torch.Tensor:
    """bitsandbytes' packed uint8 -> `count` codes, the high nibble first."""
    flat = packed.flatten().to(torch.uint8)
    return torch.stack([flat >> 4, flat & 0x0F], dim=1).flatten()[:count]


def pack_bnb(codes: torch.Tensor) -> torch.Tensor:
    """unpack_bnb's inverse: [M] codes -> uint8 [ceil(M / 2), 1]."""
    flat = torch.nn.functional.pad(codes.flatten().to(torch.uint8), (0, codes.numel() % 2))
    return ((flat[0::2] << 4) | flat[1::2]).unsqueeze(1)


# --- the graph side ------------------------------------------------------------------------
def bnb_quant_type(code: torch.Tensor) -> int | None:
    """MatMulBnb4's quant_type for a code book it has built in (0 FP4, 1 NF4), else None."""
    for quant_type, table in ((1, NF4_CODE), (0, FP4_CODE)):
        if torch.equal(code, table):
            return quant_type
    return None


def codebook_matmul(g: Any, operator_set: str, x: str, name: str, q: QuantizedLinear) -> str:
    """x @ wᵀ for a code-book linear: ONNX Runtime's MatMulBnb4 where the target allows
    contrib operators and the code book is one it knows, else standard ONNX (codes cast
    to indices, a Gather of the code book, the block scales multiplied, MatMul)."""
    n, k = q.shape
    quant_type = bnb_quant_type(q.codebook)
    if operator_set == "onnxruntime" and quant_type is not None:
        inputs = [x, g.weight(f"{name}.B", pack_bnb(q.codes).numpy().reshape(-1)),
                  g.weight(f"{name}.absmax", q.scales.numpy().reshape(-1).astype(np.float32))]
        return g.op("MatMulBnb4", inputs, name="matmul_bnb4", domain="com.microsoft",
                    K=k, N=n, block_size=q.group_size, quant_type=quant_type)
    return g.op("MatMul", [x, _standard_weight(g, name, q)])


def _standard_weight(g: Any, name: str, q: QuantizedLinear) -> str:
    """wᵀ [K, N] in standard ONNX from uint4 codes [K, N], the code book and scales [G, 1, N]."""
    import ml_dtypes

    n, k = q.shape
    if k % q.group_size:
        raise ValueError(f"{name}: code-book weights need the block size to divide K")
    codes = g.weight(f"{name}.codes", q.codes.numpy().T.astype(ml_dtypes.uint4))
    table = g.weight(f"{name}.codebook", q.codebook.numpy().astype(np.float32))
    values = g.op("Gather", [table, g.op("Cast", [codes], to=7)], name=f"{name}.lookup")
    scales = q.scales.numpy().T.reshape(k // q.group_size, 1, n).astype(np.float32)
    blocked = g.op("Reshape", [values, g.const([k // q.group_size, q.group_size, n])])
    scaled = g.op("Mul", [blocked, g.weight(f"{name}.scales", scales)])
    return g.op("Reshape", [scaled, g.const([k, n])], name=f"{name}.dequantized")


def read_codebook_linear(initializers: dict[str, np.ndarray], name: str,
                         attrs: dict[str, Any]) -> QuantizedLinear:
    """codebook_matmul's inverse: a compiled graph's code-book linear `name` back."""
    if f"{name}.absmax" in initializers:  # MatMulBnb4
        n, k, block = attrs["N"], attrs["K"], attrs["block_size"]
        code = NF4_CODE if attrs.get("quant_type", 1) == 1 else FP4_CODE
        codes = unpack_bnb(torch.from_numpy(np.array(initializers[f"{name}.B"])), n * k)
        scales = torch.from_numpy(np.array(initializers[f"{name}.absmax"], dtype=np.float32))
        codes, scales = codes.reshape(n, k), scales.reshape(n, k // block)
    else:  # standard: uint4 codes [K, N], the code book, scales [G, 1, N]
        codes = torch.from_numpy(np.asarray(initializers[f"{name}.codes"]).astype(np.uint8).T)
        code = torch.from_numpy(np.array(initializers[f"{name}.codebook"], dtype=np.float32))
        grouped = np.array(initializers[f"{name}.scales"], dtype=np.float32)
        scales = torch.from_numpy(np.ascontiguousarray(grouped[:, 0, :].T))
        block = codes.shape[1] // scales.shape[1]
    return QuantizedLinear(4, block, codes.contiguous(), scales.contiguous(),
                           torch.zeros_like(scales), True, codebook=code.clone())
