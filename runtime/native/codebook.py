"""Code-book 4-bit projections (NF4, FP4: MatMulBnb4's inputs) in the native step's terms.

The kernels read them as 4-bit codes with zero points of 128 and a 16-byte table that
turns each code into an unsigned 8-bit value (runtime/native/nf4.c): the code book is
rounded to 127ths of each block's absmax, the one step the native path adds to the graph's
float code book (besides int8 activations, as for integer codes).
"""

from __future__ import annotations

import numpy as np

from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.native.plan import QuantizedMatrix


def lookup_table(codebook: tuple[float, ...]) -> np.ndarray:
    """uint8 [16]: round(127 * value) + 128 for each code (the code book spans [-1, 1])."""
    values = np.asarray(codebook, dtype=np.float64)
    if values.shape != (16,) or np.abs(values).max() > 1:
        raise ValueError("a 4-bit code book has 16 values in [-1, 1]")
    return (np.rint(values * 127) + 128).astype(np.uint8)


def codebook_arrays(spec: QuantizedMatrix, packed: np.ndarray, absmax: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """bitsandbytes-packed codes [N*K/2] and absmax [N*K/block] as MatMulNBits-packed codes
    [N, K/2] (low nibble first), scales absmax / 127 [N, B], zero points of 128 in the
    kernels' [groups, B, 16] layout, and the lookup table."""
    n, k, block = spec.n, spec.k, spec.block
    flat = packed.reshape(-1)
    codes = np.stack([flat >> 4, flat & 15], axis=-1).reshape(n, k)
    nbits = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = absmax.reshape(n, k // block).astype(np.float32) / np.float32(127)
    zeros = np.full((cdiv(n, 16), cdiv(k, block), 16), 128, np.uint8)
    return nbits, scales, zeros, lookup_table(spec.codebook)
