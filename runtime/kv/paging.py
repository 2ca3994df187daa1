"""Block arithmetic of the paged KV cache, shared by the block manager and step builders."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for `a` tokens in blocks of `b`."""
    return -(-a // b)


def slots_of(block_table: Sequence[int], start: int, num_tokens: int,
             block_size: int) -> list[int]:
    """Pool slots of positions start .. start + num_tokens - 1 of a sequence (Python ints:
    a decode step asks for one slot of every sequence, where numpy calls cost more than
    the arithmetic)."""
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, start + num_tokens)]


def step_blocks(block_tables: list[list[int]], context_lens: np.ndarray,
                query_lens: np.ndarray, block_size: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks a step reached, from each sequence's continued block on: (sequence,
    step block index, block id), one entry per block."""
    seqs, steps, block_ids = [], [], []
    for b, table in enumerate(block_tables):
        first = int(context_lens[b]) // block_size
        last = (int(context_lens[b] + query_lens[b]) - 1) // block_size
        seqs += [b] * (last + 1 - first)
        steps += range(last + 1 - first)
        block_ids += table[first:last + 1]
    return np.array(seqs), np.array(steps), np.array(block_ids)


# The lanes layout: lane l owns blocks 1 + l*L .. (l+1)*L (block 0 is the null block).
def num_lanes(num_blocks: int, lane_blocks: int) -> int:
    """Lanes of `lane_blocks` blocks a pool of `num_blocks` holds (at least one)."""
    lanes = (num_blocks - 1) // lane_blocks
    if lanes < 1:
        raise ValueError(f"{num_blocks} KV blocks hold no lane of {lane_blocks} blocks "
                         "(one sequence of max_context tokens)")
    return lanes


def lane_block(lane: int, index: int, lane_blocks: int) -> int:
    """Block id of block `index` of `lane`."""
    return 1 + lane * lane_blocks + index


def lane_position(block_id: int, lane_blocks: int) -> tuple[int, int]:
    """(lane, index within the lane) of a block."""
    return divmod(block_id - 1, lane_blocks)
