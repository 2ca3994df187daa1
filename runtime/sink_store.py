"""SinkStore: the first `sink_tokens` keys and values of each sequence, unrounded.

A layer whose KV cache is quantized may keep its attention sinks (the first positions,
which every later query attends to heavily) in float32 beside the pool (manifest
`kv_cache.sink_tokens`, see contract). The store has one row per distinct first block:
sequences that share a cached prefix share its first block, and with it their sinks, so
a prefix-cache hit finds them here as it finds the blocks in the pool. A row lives as
long as its block's contents: when the block pool hands the block out again
(`forget_block`), the row is free for another sequence.
"""

from __future__ import annotations

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.manifest import KVCacheSpec

_FIRST_ROWS = 8  # grown by doubling: rows in use are distinct live or cached first blocks


class SinkStore:
    def __init__(self, kv_cache: KVCacheSpec):
        self.sink_tokens = kv_cache.sink_tokens
        # sink input name -> [rows, sink_tokens, *slot_shape]; new_sink output -> input name
        self.arrays: dict[str, np.ndarray] = {}
        self.new_to_store: dict[str, str] = {}
        for i, layer in enumerate(kv_cache.layers):
            for t in layer.sink:
                name = contract.sink_name(i, t.name)
                self.arrays[name] = np.zeros((_FIRST_ROWS, self.sink_tokens, *t.slot_shape),
                                             dtype=t.dtype)
                self.new_to_store[contract.new_sink_name(i, t.name)] = name
        self.row_of_block: dict[int, int] = {}
        self.free_rows = list(range(_FIRST_ROWS - 1, -1, -1))
        self.grown = False  # set when the arrays were reallocated (bindings are stale)

    def __bool__(self) -> bool:
        return bool(self.arrays)

    def rows_for(self, first_blocks: list[int]) -> np.ndarray:
        """Each sequence's row (by its first block), taking a free row for a new block."""
        rows = np.empty(len(first_blocks), dtype=np.int64)
        for b, block in enumerate(first_blocks):
            if block not in self.row_of_block:
                self.row_of_block[block] = self._take_row()
            rows[b] = self.row_of_block[block]
        return rows

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

    def forget_block(self, block_id: int) -> None:
        """The block holds new contents now: its row (if any) is free."""
        row = self.row_of_block.pop(block_id, None)
        if row is not None:
            self.free_rows.append(row)

    def copy_block(self, source: int, destination: int) -> None:
        """A copied first block brings its sinks along (lanes' prefix-cache copies)."""
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
