"""RowStore: float arrays with one row per KV block id, beside the pool.

What a quantized layer keeps unrounded outside its pool (attention sinks, the keys of a
block still filling) belongs to a block's contents, so it is kept by block id: a row is
taken when a block first needs one and freed when the block pool hands the block out
again (`forget_block`). The arrays grow by doubling; `grown` tells an executor that the
arrays it bound were replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

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
