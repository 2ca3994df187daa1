"""Group-wise integer weights: the offline transform and how the graph consumes it.

Both halves live here so they cannot drift: `group_quantize` and `QuantizedLinear`
define the numbers, `pack_matmul_nbits` lays them out for ONNX Runtime's MatMulNBits.

A linear weight w [N, K] (out, in) is cut along K into groups of `group_size` (the last
group may be shorter: SmolLM2's 576 is not a multiple of 128). Each group of each row has
a float scale and a zero point, and w ≈ (q - zero) * scale with integer codes
q in [0, 2^bits). Symmetric quantization fixes zero = 2^(bits-1); GGUF's Q4_1 has a
fractional zero (-min/scale), which MatMulNBits accepts as a float zero point.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import torch


@dataclass(frozen=True)
class QuantizedLinear:
    bits: int
    group_size: int
    codes: torch.Tensor  # uint8 [N, K], values in [0, 2^bits)
    scales: torch.Tensor  # float32 [N, G], G = ceil(K / group_size)
    zeros: torch.Tensor  # float32 [N, G]
    symmetric: bool
    # A 16-value code book (NF4, FP4: compiler/nf4.py): w = codebook[code] * scale, zeros 0.
    codebook: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these codes stand for."""
        n, k = self.codes.shape
        if k % self.group_size == 0 and self.codebook is None:
            # whole groups: scales broadcast over each group, in place (no [N, K] copies)
            weight = self.codes.reshape(n, -1, self.group_size).float()
            weight.sub_(self.zeros.unsqueeze(-1)).mul_(self.scales.unsqueeze(-1))
            return weight.view(n, k)
        scales = expand_groups(self.scales, self.group_size, self.codes.shape[1])
        if self.codebook is not None:
            return self.codebook[self.codes.long()] * scales
        zeros = expand_groups(self.zeros, self.group_size, self.codes.shape[1])
        return (self.codes.float() - zeros) * scales

    def row_blocks(self, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The dequantized weight in blocks of `rows` rows: never whole in float32."""
        for start in range(0, self.codes.shape[0], rows):
            stop = start + rows
            part = replace(self, codes=self.codes[start:stop], scales=self.scales[start:stop],
                           zeros=self.zeros[start:stop])
            yield start, part.dequantize()

    def integer_zeros(self) -> bool:
        return bool(torch.equal(self.zeros, self.zeros.round()))


def expand_groups(per_group: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """[N, G] -> [N, K]: each group's value repeated over its columns."""
    return per_group.repeat_interleave(group_size, dim=1)[:, :k]


def group_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group_size], the short last group padded by repeating its edge
    value (so padding never widens a group's range)."""
    n, k = w.shape
    pad = -k % group_size
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    return w.reshape(n, -1, group_size)


def quant_params(
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool, clip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest scales and zeros [N, G] of w; `clip` [N, G] shrinks each group's
    range (AWQ's and GPTQ's clipping search)."""
    groups = group_view(w, group_size)
    w_max, w_min = groups.amax(dim=-1), groups.amin(dim=-1)
    if clip is not None:
        w_max, w_min = w_max * clip, w_min * clip
    levels = 2**bits - 1
    if symmetric:
        # The group's extreme (largest magnitude, with its sign) takes code 0, i.e. -half:
        # the scale is negative when the extreme is positive. Codes span [-half, half), so
        # the extreme's side gets all `half` levels; absmax / (half - 0.5) would waste half a
        # level on each side (llama.cpp's Q4_0 rule; benchmarks/probes/probe_symmetric_scales.py).
        half = 2 ** (bits - 1)
        extreme = torch.where(w_max.abs() >= w_min.abs(), w_max, w_min)
        scales = extreme / -half
        scales = torch.where(scales.abs() < 1e-10, torch.full_like(scales, 1e-10), scales)
        zeros = torch.full_like(scales, float(half))
    else:
        w_max, w_min = w_max.clamp(min=0), w_min.clamp(max=0)  # zero is exactly representable
        scales = ((w_max - w_min) / levels).clamp(min=1e-10)
        zeros = (-w_min / scales).round().clamp(0, levels)
    return scales, zeros


def quantize_with(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """Integer codes of w [N, K] under given per-group scales and zeros."""
    k = w.shape[1]
    codes = w / expand_groups(scales, group_size, k) + expand_groups(zeros, group_size, k)
    return codes.round().clamp(0, 2**bits - 1).to(torch.uint8)


def group_quantize(
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool, clip: torch.Tensor | None = None
) -> QuantizedLinear:
    """Round-to-nearest (RTN) group quantization of a float weight [N, K]."""
    w = w.float()
    scales, zeros = quant_params(w, bits, group_size, symmetric, clip)
    codes = quantize_with(w, scales, zeros, bits, group_size)
    return QuantizedLinear(bits, group_size, codes, scales, zeros, symmetric)


def concat_outputs(parts: list[QuantizedLinear]) -> QuantizedLinear:
    """Stack linears along N (fused QKV or gate/up): same bits and groups along K."""
    first = parts[0]
    if any((p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1])
           or not _same_codebook(p.codebook, first.codebook) for p in parts):
        raise ValueError("fused projections need the same bits, group size, code book and "
                         "input width")
    return QuantizedLinear(
        first.bits, first.group_size,
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]), all(p.symmetric for p in parts), first.codebook,
    )


def _same_codebook(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def split_fractional_zeros(q: QuantizedLinear) -> tuple[QuantizedLinear, np.ndarray]:
    """w = s(c - z) = s(c - h) + s(h - z), h = 2^(bits-1): symmetric codes plus a per-group
    offset O = s(h - z), returned [G, N]. Then x·wᵀ = x·w_symᵀ + (x·E)·O with E [K, G] the
    0/1 matrix that sums each group's inputs — exact, and it keeps fractional zero points
    (GGUF Q4_1) off ONNX Runtime's slow float-zero-point MatMulNBits path."""
    half = float(2 ** (q.bits - 1))
    symmetric = QuantizedLinear(q.bits, q.group_size, q.codes, q.scales,
                                torch.full_like(q.scales, half), True)
    offset = ((half - q.zeros) * q.scales).T.contiguous().numpy().astype(np.float32)
    return symmetric, offset


def group_sum_matrix(k: int, group_size: int) -> np.ndarray:
    """E [K, G]: E[i, i // group_size] = 1."""
    groups = -(-k // group_size)
    matrix = np.zeros((k, groups), dtype=np.float32)
    matrix[np.arange(k), np.arange(k) // group_size] = 1.0
    return matrix


# --- the graph side: ONNX Runtime's MatMulNBits ------------------------------------------
def pack_matmul_nbits(q: QuantizedLinear) -> dict[str, np.ndarray]:
    """MatMulNBits inputs: B uint8 [N, k_blocks, blob], scales [N, k_blocks] and, unless
    symmetric (implicit zero 2^(bits-1)), zero points — packed uint8 when integral, float
    otherwise (correct, but a slow path in ONNX Runtime: see split_fractional_zeros).
    Codes are packed low bits first along K; the short last block is padded with zero
    codes, which the kernel never reads past K."""
    _integer_codes(q)
    n, k = q.shape
    k_blocks = -(-k // q.group_size)
    codes = np.zeros((n, k_blocks * q.group_size), dtype=np.uint8)
    codes[:, :k] = q.codes.numpy()
    per_byte = 8 // q.bits
    codes = codes.reshape(n, k_blocks, q.group_size // per_byte, per_byte)
    packed = np.zeros(codes.shape[:3], dtype=np.uint8)
    for i in range(per_byte):
        packed |= codes[..., i] << (q.bits * i)
    arrays = {"B": packed, "scales": q.scales.numpy().astype(np.float32)}
    if not q.symmetric:
        arrays["zero_points"] = (_pack_zero_points(q.zeros.numpy(), q.bits)
                                 if q.integer_zeros() else q.zeros.numpy().astype(np.float32))
    return arrays


def _integer_codes(q: QuantizedLinear) -> None:
    if q.codebook is not None:
        raise ValueError("code-book weights (NF4/FP4) have no integer-code packing: see nf4.py")


def _pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [N, ceil(G * bits / 8)]: each row's zero points packed low bits first."""
    per_byte = 8 // bits
    n, groups = zeros.shape
    padded = np.zeros((n, -(-groups // per_byte) * per_byte), dtype=np.uint8)
    padded[:, :groups] = zeros.astype(np.uint8)
    padded = padded.reshape(n, -1, per_byte)
    packed = np.zeros(padded.shape[:2], dtype=np.uint8)
    for i in range(per_byte):
        packed |= padded[..., i] << (bits * i)
    return packed


# --- the graph side: standard ONNX, blocked DequantizeLinear (opset 21) → MatMul ---------
def pack_dequantize_linear(q: QuantizedLinear) -> dict[str, np.ndarray]:
    """DequantizeLinear inputs for MatMul's B = wᵀ [K, N], blocked along K (axis 0).

    Symmetric codes become signed (q - 2^(bits-1)) with no zero point at all — TensorRT's
    dequantize accepts only zero zero-points; asymmetric ones stay unsigned with unsigned
    zero points. Fractional zero points have no DequantizeLinear form: split them first
    (split_fractional_zeros).
    """
    _integer_codes(q)
    if not q.integer_zeros():
        raise ValueError("DequantizeLinear needs integer zero points")
    codes = q.codes.numpy().T.astype(np.int16)
    scales = np.ascontiguousarray(q.scales.numpy().T, dtype=np.float32)
    if q.symmetric:
        signed = ml_dtypes.int4 if q.bits == 4 else np.int8
        return {"x": (codes - 2 ** (q.bits - 1)).astype(signed), "x_scale": scales}
    unsigned = ml_dtypes.uint4 if q.bits == 4 else np.uint8
    zeros = q.zeros.numpy().T.astype(np.int16).astype(unsigned)
    return {"x": codes.astype(unsigned), "x_scale": scales, "x_zero_point": zeros}


# --- the inverses: reading a compiled graph's integer weights back --------------------------
def unpack_matmul_nbits(arrays: dict[str, np.ndarray], k: int, bits: int,
                        group_size: int) -> QuantizedLinear:
    """pack_matmul_nbits's inverse: B [N, k_blocks, blob], scales and optional zero points
    (packed uint8 or float) back to codes [N, K], scales and zeros [N, G]."""
    packed = arrays["B"]
    n, k_blocks, _ = packed.shape
    per_byte, mask = 8 // bits, (1 << bits) - 1
    codes = np.stack([(packed >> (bits * i)) & mask for i in range(per_byte)], axis=-1)
    codes = codes.reshape(n, k_blocks * group_size)[:, :k]
    scales = arrays["scales"].reshape(n, k_blocks).astype(np.float32)
    zero_points = arrays.get("zero_points")
    if zero_points is None:
        zeros = np.full_like(scales, 2.0 ** (bits - 1))
    elif zero_points.dtype == np.uint8:
        zeros = _unpack_zero_points(zero_points.reshape(n, -1), bits, k_blocks)
    else:
        zeros = zero_points.reshape(n, k_blocks).astype(np.float32)
    return QuantizedLinear(bits, group_size, torch.from_numpy(np.ascontiguousarray(codes)),
                           torch.from_numpy(scales), torch.from_numpy(zeros),
                           zero_points is None)


def _unpack_zero_points(packed: np.ndarray, bits: int, groups: int) -> np.ndarray:
    per_byte, mask = 8 // bits, (1 << bits) - 1
    zeros = np.stack([(packed >> (bits * i)) & mask for i in range(per_byte)], axis=-1)
    return zeros.reshape(packed.shape[0], -1)[:, :groups].astype(np.float32)


def unpack_dequantize_linear(arrays: dict[str, np.ndarray], group_size: int) -> QuantizedLinear:
    """pack_dequantize_linear's inverse: x [K, N] (signed codes when symmetric, no zero
    point), x_scale and x_zero_point [G, N] back to a QuantizedLinear [N, K]."""
    x = arrays["x"]
    bits = 4 if x.dtype in (ml_dtypes.int4, ml_dtypes.uint4) else 8
    symmetric = "x_zero_point" not in arrays
    codes = x.astype(np.int16).T
    scales = np.ascontiguousarray(arrays["x_scale"].T, dtype=np.float32)
    if symmetric:
        codes = codes + 2 ** (bits - 1)
        zeros = np.full_like(scales, 2.0 ** (bits - 1))
    else:
        zeros = np.ascontiguousarray(arrays["x_zero_point"].astype(np.int16).T, dtype=np.float32)
    return QuantizedLinear(bits, group_size,
                           torch.from_numpy(np.ascontiguousarray(codes.astype(np.uint8))),
                           torch.from_numpy(scales), torch.from_numpy(zeros), symmetric)


def join_fractional_zeros(q: QuantizedLinear, offset: np.ndarray) -> QuantizedLinear:
    """split_fractional_zeros's inverse: symmetric codes and the offset O [G, N] back to
    one linear with zeros z = h - O / s (exact up to float rounding)."""
    half = float(2 ** (q.bits - 1))
    zeros = half - torch.from_numpy(np.ascontiguousarray(offset.T, dtype=np.float32)) / q.scales
    return QuantizedLinear(q.bits, q.group_size, q.codes, q.scales, zeros, False)


def slice_outputs(q: QuantizedLinear, start: int, stop: int) -> QuantizedLinear:
    """Rows start..stop of a fused linear (concat_outputs's inverse, one part)."""
    return QuantizedLinear(q.bits, q.group_size, q.codes[start:stop], q.scales[start:stop],
                           q.zeros[start:stop], q.symmetric, q.codebook)
