"""Block arithmetic of the paged KV cache, shared by the block manager and step builders."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for `a` tokens in blocks of `b`."""
    return -(-a // b)


def slots_of(block_table: Sequence[int], start: int, num_tokens: int,
             block_size: int) -> np.ndarray:
    """int64 pool slots of positions start .. start + num_tokens - 1 of a sequence."""
    block_ids = np.asarray(block_table, dtype=np.int64)
    positions = np.arange(start, start + num_tokens, dtype=np.int64)
    return block_ids[positions // block_size] * block_size + positions % block_size
