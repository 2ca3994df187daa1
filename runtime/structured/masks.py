"""Token bitmasks: llguidance writes one bit per token (1 = allowed) into int32 words;
the engine turns the disallowed tokens' logits into -inf before sampling or verifying."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, num_words(vocab_size)), -1, dtype=np.int32)


def allow_only(bitmask: np.ndarray, row: int, token: int) -> None:
    bitmask[row] = 0
    bitmask[row, token >> 5] = np.int32(np.uint32(1 << (token & 31)).view(np.int32))


def fill_mask(matcher: Any, bitmask: np.ndarray, row: int) -> None:
    """Write `matcher`'s next-token mask into `bitmask[row]`."""
    target = bitmask[row]
    matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)


def fill_masks(executor: Any, matchers: Sequence[Any], bitmask: np.ndarray) -> None:
    """Row i of `bitmask` <- matchers[i]'s mask, computed in parallel (the GIL released)."""
    if len(matchers) == 1:
        fill_mask(matchers[0], bitmask, 0)
        return
    executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                     bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])


def apply_masks(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """A copy of `logits` [N, vocab] with each row's disallowed tokens at -inf (tokens past
    the tokenizer's vocabulary, padding of the LM head, are never allowed)."""
    vocab = logits.shape[-1]
    width = min(vocab, bitmask.shape[-1] * 32)
    allowed = np.zeros(logits.shape, dtype=bool)
    allowed[:, :width] = np.unpackbits(bitmask.view(np.uint8), axis=-1, count=width,
                                       bitorder="little").view(bool)
    return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)
