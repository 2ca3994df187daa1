"""The KV pools: the arrays that hold a graph's keys and values, which its executor reads.

Two layouts, as the manifest's `kv_cache.layout` says:

- `BlockPools` ("blocks"): one array [num_blocks, block_size, *slot_shape] per pool tensor
  (per-block tensors: [num_blocks, *slot_shape]), and the stores quantized layers keep
  beside them (the stores, below); the graph gathers the blocks it needs and returns the step's
  entries, which `write` puts where the manager assigned them.
- `LanePools` ("lanes"): one array [lanes, kv_heads, lane_tokens, head_dim] per pool
  tensor; a sequence's block table is a run of its lane's blocks, so its entries are
  contiguous and the graph reads and appends to them in place.

The pools belong to the KV cache, not to an executor: the manager's prefix-cache copies
and the block pool's reuse reach them here (`copy_block`, `forget_block`), and every
executor of a layout reads the same class.

Beside a quantized layer's pools, the "blocks" layout keeps float rows by block id
(`RowStore`): each sequence's first keys and values unrounded (`SinkStore`) and the keys
of each block still filling (`TailStore`).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.kv.paging import lane_position, num_lanes, step_blocks
from llmopt.runtime.manifest import KVCacheSpec

_FIRST_ROWS = 8


def pool_array(shape: tuple[int, ...] | list[int], dtype: np.dtype | str) -> np.ndarray:
    """A zeroed pool array on an anonymous mapping of 4 KiB pages.

    numpy advises huge pages for large arrays, so the first write into a fresh lane or
    block zeroes (and may compact memory for) 2 MiB per layer tensor; here a block's first
    write costs only the pages it touches, and untouched lanes cost no memory at all.
    """
    dtype = np.dtype(dtype)
    nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype,
                         count=int(np.prod(shape, dtype=np.int64))).reshape(shape)


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


class _Arrays(Mapping[str, np.ndarray]):
    """Read as {past name: pool array}."""

    arrays: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)


class BlockPools(_Arrays):
    """The "blocks" layout's pools, by past name, and the sink and tail stores."""

    def __init__(self, kv_cache: KVCacheSpec, *, num_blocks: int, block_size: int,
                 num_local_blocks: int | None = None):
        """`num_local_blocks`: blocks of the local group (the layers that read the local
        block table); None: as many as `num_blocks`."""
        self.block_size = block_size
        self.local_as_large = num_local_blocks in (None, num_blocks)
        self.arrays = {}
        self.new_to_past: dict[str, str] = {}  # graph output -> the pool it is written into
        self.block_to_past: dict[str, str] = {}  # ... for per-block tensors (whole blocks)
        local_outputs = set()  # outputs of the local layers (written by the local table)
        for i, layer in enumerate(kv_cache.layers):
            blocks = num_local_blocks if layer.local and num_local_blocks else num_blocks
            for t in layer.tensors:
                past = contract.past_name(i, t.name)
                if t.per == "block":
                    self.arrays[past] = pool_array((num_blocks, *t.slot_shape), t.dtype)
                    self.block_to_past[contract.new_block_name(i, t.name)] = past
                    continue
                shape = (blocks, block_size, *t.slot_shape)
                self.arrays[past] = pool_array(shape, t.dtype)
                self.new_to_past[contract.new_name(i, t.name)] = past
                if layer.local:
                    local_outputs.add(contract.new_name(i, t.name))
        # What quantized layers keep unrounded beside the pool, by block (see contract).
        self.sinks, self.tails = SinkStore(kv_cache), TailStore(kv_cache)
        # Flat [slots, *slot_shape] views of the pools, by the graph output written there.
        flat = {new: self.arrays[past].reshape(-1, *self.arrays[past].shape[2:])
                for new, past in self.new_to_past.items()}
        self.flat = {new: view for new, view in flat.items() if new not in local_outputs}
        self.local_flat = {new: view for new, view in flat.items() if new in local_outputs}

    def store_inputs(self, block_tables: list[list[int]],
                     context_lens: np.ndarray) -> dict[str, np.ndarray]:
        """The stores' row inputs of a step: the rows its sequences read and write."""
        inputs = {}
        if self.sinks:
            inputs[contract.SINK_ROWS] = self.sinks.rows_for([table[0] for table in block_tables])
        if self.tails:
            inputs[contract.TAIL_ROWS] = self.tails.rows_continued(block_tables, context_lens)
        return inputs

    def write(self, outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
              slots: np.ndarray, block_tables: list[list[int]], query_lens: np.ndarray,
              local_slots: np.ndarray | None = None) -> None:
        """Write a step's new entries (graph `outputs`) where the manager assigned them
        (`local_slots`: those of the layers that read the local block table)."""
        write_slots(self.flat, outputs, slots)
        if self.local_flat:
            if local_slots is None:
                raise ValueError("a step of a graph with sliding-window blocks needs their "
                                 "slots (the KV manager's local block tables)")
            write_slots(self.local_flat, outputs, local_slots)
        context_lens = inputs[contract.CONTEXT_LENS]
        if self.block_to_past:
            self._write_blocks(outputs, block_tables, context_lens, query_lens)
        if self.sinks:
            self.sinks.write(outputs, inputs[contract.SINK_ROWS], context_lens, query_lens)
        if self.tails:
            self.tails.write(outputs, block_tables, context_lens, query_lens)

    def _write_blocks(self, outputs: dict[str, np.ndarray], block_tables: list[list[int]],
                      context_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """Write each sequence's step blocks (from the one it continued) that it reached."""
        seqs, steps, block_ids = step_blocks(block_tables, context_lens, query_lens,
                                             self.block_size)
        for name, past in self.block_to_past.items():
            self.arrays[past][block_ids] = outputs[name][seqs, steps]

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block of every pool tensor, and its sink row."""
        for pool in self.arrays.values():
            pool[destination] = pool[source]
        self.sinks.copy_block(source, destination)

    def forget_block(self, block_id: int) -> None:
        """The block pool hands `block_id` out again: what was kept for it is stale."""
        self.sinks.forget_block(block_id)
        self.tails.forget_block(block_id)

    def release_block(self, block_id: int) -> None:
        """No sequence holds `block_id` any more: nobody will continue filling it."""
        self.tails.forget_block(block_id)


def write_slots(flat: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                slots: np.ndarray) -> None:
    """Write each output's rows into its flat pool at `slots` (padded rows, -1, skipped)."""
    keep = slots >= 0  # padded query rows are garbage and never written
    kept_slots = slots[keep]
    for name, flat_pool in flat.items():
        flat_pool[kept_slots] = outputs[name].reshape(-1, *flat_pool.shape[1:])[keep]


class LanePools(_Arrays):
    """The "lanes" layout's pools: [lanes, kv_heads, lane_tokens, head_dim] by past name,
    and where a block table's sequence lives in them."""

    def __init__(self, kv_cache: KVCacheSpec, *, num_blocks: int, block_size: int,
                 lane_blocks: int):
        self.block_size, self.lane_blocks = block_size, lane_blocks
        self.num_lanes = num_lanes(num_blocks, lane_blocks)
        self.lane_tokens = lane_tokens = lane_blocks * block_size
        self.num_layers = len(kv_cache.layers)
        self.arrays = {}
        for i, layer in enumerate(kv_cache.layers):
            for t in layer.tensors:
                kv_heads, head_dim = t.slot_shape
                self.arrays[contract.past_name(i, t.name)] = pool_array(
                    (self.num_lanes, kv_heads, lane_tokens, head_dim), t.dtype)

    def lane_of(self, block_table: list[int]) -> int:
        """The lane a block table runs through (its blocks must be the lane's, in order)."""
        lane, offset = lane_position(block_table[0], self.lane_blocks)
        if offset or block_table[-1] != block_table[0] + len(block_table) - 1:
            raise ValueError(f"block table {block_table[:4]}... is not a lane's run of blocks")
        return lane

    def move_entries(self, block_table: list[int], sources: list[int],
                     destinations: list[int]) -> None:
        """Copy a sequence's entries at positions `sources` to `destinations` (an accepted
        tree branch); a lane's position is its row."""
        lane = self.lane_of(block_table)
        for pool in self.arrays.values():
            pool[lane, :, destinations] = pool[lane, :, sources]

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's keys and values (a prefix-cache hit held by another lane)."""
        (src_lane, src), (dst_lane, dst) = (lane_position(b, self.lane_blocks)
                                            for b in (source, destination))
        bs = self.block_size
        for pool in self.arrays.values():
            pool[dst_lane, :, dst * bs:(dst + 1) * bs] = pool[src_lane, :, src * bs:(src + 1) * bs]


KVPools = BlockPools | LanePools


def make_pools(kv_cache: KVCacheSpec, *, num_blocks: int, block_size: int,
               lane_blocks: int | None, num_local_blocks: int | None = None) -> KVPools:
    """The pools of a graph's KV layout (lanes need the lane size; the local group of
    sliding-window layers, where the blocks layout has one, `num_local_blocks`)."""
    if kv_cache.layout == "lanes":
        if lane_blocks is None:
            raise ValueError("a lanes-layout graph needs a lane size")
        return LanePools(kv_cache, num_blocks=num_blocks, block_size=block_size,
                         lane_blocks=lane_blocks)
    return BlockPools(kv_cache, num_blocks=num_blocks, block_size=block_size,
                      num_local_blocks=num_local_blocks)
