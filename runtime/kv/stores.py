"""The float arrays quantized layers keep beside the KV pools, one row per block id.

- `RowStore`: rows kept by block id (what a quantized layer keeps unrounded outside its
  pool belongs to a block's contents): a row is taken when a block first needs one and
  freed when the block pool hands the block out again (`forget_block`). The arrays grow
  by doubling; `grown` tells an executor that the arrays it bound were replaced.
- `SinkStore`: the first `sink_tokens` keys and values of each sequence, unrounded.
- `TailStore`: the keys of each block still filling, unrounded (per-block key scales).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.kv.paging import step_blocks
from llmopt.runtime.manifest import KVCacheSpec

_FIRST_ROWS = 8


class RowStore:
    def __init__(self, shapes: dict[str, tuple[list[int], str]]):
        """`shapes`: array name -> (one row's shape, dtype)."""
        self.arrays = {name: np.zeros((_FIRST_ROWS, *shape), dtype=dtype)
                       for name, (shape, dtype) in shapes.items()}
        self.row_of_block: dict[int, int] = {}
        self.free_rows = list(range(_FIRST_ROWS - 1, -1, -1))
        self.grown = False  # set when the arrays were reallocated (bindings are stale)

    def __bool__(self) -> bool:
        return bool(self.arrays)

    def rows_for(self, blocks: list[int]) -> np.ndarray:
        """Each block's row, taking a free row for a block that has none."""
        rows = np.empty(len(blocks), dtype=np.int64)
        for b, block in enumerate(blocks):
            if block not in self.row_of_block:
                self.row_of_block[block] = self._take_row()
            rows[b] = self.row_of_block[block]
        return rows

    def forget_block(self, block_id: int) -> None:
        """The block's contents are gone: its row (if any) is free."""
        row = self.row_of_block.pop(block_id, None)
        if row is not None:
            self.free_rows.append(row)

    def copy_block(self, source: int, destination: int) -> None:
        """A copied block brings its row along (lanes' prefix-cache copies)."""
        if source in self.row_of_block:
            [row] = self.rows_for([destination])
            for array in self.arrays.values():
                array[row] = array[self.row_of_block[source]]

    def _take_row(self) -> int:
        if not self.free_rows:
            rows = next(iter(self.arrays.values())).shape[0]
            for name, array in self.arrays.items():
                self.arrays[name] = np.concatenate([array, np.zeros_like(array)])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
            self.grown = True
        return self.free_rows.pop()


def layer_arrays(kv_cache: KVCacheSpec, kind: str, positions: int,
                 input_name: Callable[[int, str], str], output_name: Callable[[int, str], str]
                 ) -> tuple[dict[str, tuple[list[int], str]], dict[str, str]]:
    """The arrays of each layer's `kind` tensors ("sink", "tail"), `positions` rows each:
    ({input name: (row shape, dtype)}, {the step output written there: input name})."""
    shapes, new_to_store = {}, {}
    for i, layer in enumerate(kv_cache.layers):
        for t in getattr(layer, kind):
            shapes[input_name(i, t.name)] = ([positions, *t.slot_shape], t.dtype)
            new_to_store[output_name(i, t.name)] = input_name(i, t.name)
    return shapes, new_to_store


class SinkStore(RowStore):
    """The first `sink_tokens` keys and values of each sequence, unrounded.

    A layer whose KV cache is quantized may keep its attention sinks (the first positions,
    which every later query attends to heavily) in float32 beside the pool (manifest
    `kv_cache.sink_tokens`, see contract). The store has one row per distinct first block:
    sequences that share a cached prefix share its first block, and with it their sinks, so
    a prefix-cache hit finds them here as it finds the blocks in the pool.
    """

    def __init__(self, kv_cache: KVCacheSpec):
        self.sink_tokens = kv_cache.sink_tokens
        shapes, self.new_to_store = layer_arrays(kv_cache, "sink", self.sink_tokens,
                                                 contract.sink_name, contract.new_sink_name)
        super().__init__(shapes)

    def write(self, outputs: dict[str, np.ndarray], rows: np.ndarray,
              context_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """Keep the step's rows at positions below `sink_tokens` (padded rows excluded)."""
        for b, row in enumerate(rows):
            first, last = int(context_lens[b]), int(context_lens[b] + query_lens[b])
            end = min(last, self.sink_tokens)
            if first >= end:
                continue
            for new, store in self.new_to_store.items():
                self.arrays[store][row, first:end] = outputs[new][b, : end - first]


class TailStore(RowStore):
    """The keys of each block still filling, unrounded (per-block key scales).

    A layer that scales keys per channel within each block can only quantize a block once
    it is full; until then its keys wait here in float32, one row per block (see contract).
    A sequence needs the row of the block it continues, and the rows of every block its
    step wrote (a step may keep fewer tokens than it computed and continue an earlier
    block). Rows of blocks before the one a step continues, and of blocks freed, are
    released.
    """

    def __init__(self, kv_cache: KVCacheSpec):
        self.block_size = kv_cache.block_size
        shapes, self.new_to_store = layer_arrays(kv_cache, "tail", self.block_size or 0,
                                                 contract.tail_name, contract.new_tail_name)
        super().__init__(shapes)

    def rows_continued(self, block_tables: list[list[int]], context_lens: np.ndarray
                       ) -> np.ndarray:
        """Each sequence's row of the block it continues; rows of its earlier blocks,
        complete and committed, are released."""
        continued = []
        for table, context in zip(block_tables, context_lens, strict=True):
            first = int(context) // self.block_size
            for block in table[:first]:
                self.forget_block(block)
            continued.append(table[first])
        return self.rows_for(continued)

    def write(self, outputs: dict[str, np.ndarray], block_tables: list[list[int]],
              context_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """Keep each sequence's step rows in the rows of the blocks they fall in."""
        bs = self.block_size
        seqs, _, blocks = step_blocks(block_tables, context_lens, query_lens, bs)
        block_rows = self.rows_for(blocks.tolist())  # the step's blocks, sequence by sequence
        first_of_seq = np.searchsorted(seqs, np.arange(len(block_tables)))
        token_seqs = np.repeat(np.arange(len(block_tables)), query_lens)
        token_steps = np.arange(len(token_seqs)) - np.repeat(np.cumsum(query_lens) - query_lens,
                                                             query_lens)
        positions = context_lens[token_seqs] + token_steps
        in_step = positions // bs - context_lens[token_seqs] // bs  # step block of each token
        rows = block_rows[first_of_seq[token_seqs] + in_step]
        for new, store in self.new_to_store.items():
            self.arrays[store][rows, positions % bs] = outputs[new][token_seqs, token_steps]
