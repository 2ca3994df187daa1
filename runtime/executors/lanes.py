"""LaneExecutor: runs a lanes-layout graph with the KV pool read and written in place.

Each pool tensor is one array [lanes, kv_heads, lane_tokens, head_dim]; a sequence's
block table is a run of its lane's blocks (`LaneKVCacheManager`), so its keys and values
are contiguous and ONNX Runtime's GroupQueryAttention appends to them where they lie.
A graph call takes the rows of a range of lanes (right-padded queries; lanes in the range
that are not in the call are idle rows), binding the pools' [lo:hi] slices, which share
the arrays' memory, as both the `past` inputs and the `present` outputs. Nothing is
gathered, concatenated or scattered.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmopt.runtime import contract
from llmopt.runtime.executors.gathered import (
    check_graph_io,
    open_session,
    padding_groups,
    select_sequences,
)
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.paging import lane_position, num_lanes
from llmopt.runtime.manifest import KVCacheSpec

MAX_BINDINGS = 32  # lane ranges whose pool bindings are kept ready


class LanePools:
    """The KV pools of a lanes graph: one array [lanes, kv_heads, lane_tokens, head_dim] per
    pool tensor, and where a block table's sequence lives in them."""

    def __init__(self, kv_cache: KVCacheSpec, *, num_blocks: int, block_size: int,
                 lane_blocks: int):
        self.block_size, self.lane_blocks = block_size, lane_blocks
        self.num_lanes = num_lanes(num_blocks, lane_blocks)
        self.lane_tokens = lane_tokens = lane_blocks * block_size
        self.pools: dict[str, np.ndarray] = {}  # past name -> [lanes, kv_heads, tokens, dim]
        for i, layer in enumerate(kv_cache.layers):
            for t in layer.tensors:
                kv_heads, head_dim = t.slot_shape
                self.pools[contract.past_name(i, t.name)] = np.zeros(
                    (self.num_lanes, kv_heads, lane_tokens, head_dim), dtype=t.dtype)

    def lane_of(self, block_table: list[int]) -> int:
        """The lane a block table runs through (its blocks must be the lane's, in order)."""
        lane, offset = lane_position(block_table[0], self.lane_blocks)
        if offset or block_table[-1] != block_table[0] + len(block_table) - 1:
            raise ValueError(f"block table {block_table[:4]}... is not a lane's run of blocks")
        return lane

    def move_entries(self, block_table: list[int], sources: list[int],
                     destinations: list[int]) -> None:
        """Copy a sequence's entries at positions `sources` to `destinations` (an accepted
        draft-tree branch); a lane's position is its row."""
        lane = self.lane_of(block_table)
        for pool in self.pools.values():
            pool[lane, :, destinations] = pool[lane, :, sources]

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's keys and values (a prefix-cache hit held by another lane)."""
        (src_lane, src), (dst_lane, dst) = (lane_position(b, self.lane_blocks)
                                            for b in (source, destination))
        bs = self.block_size
        for pool in self.pools.values():
            pool[dst_lane, :, dst * bs:(dst + 1) * bs] = pool[src_lane, :, src * bs:(src + 1) * bs]


class LaneExecutor(LanePools):
    def __init__(
        self,
        graph_path: str | Path,
        kv_cache: KVCacheSpec,
        *,
        num_blocks: int,
        block_size: int,
        lane_blocks: int,
        num_threads: int | None = None,
        optimization_level: str = "all",
        nbits_accuracy_level: int = 0,
    ):
        super().__init__(kv_cache, num_blocks=num_blocks, block_size=block_size,
                         lane_blocks=lane_blocks)
        self.session = open_session(graph_path, num_threads, optimization_level,
                                    nbits_accuracy_level)
        presents = {contract.present_of(name) for name in self.pools}
        check_graph_io(self.session, {contract.INPUT_IDS, contract.QUERY_SEQLENS,
                                      contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH,
                                      contract.LOGITS_INDICES, *self.pools},
                       {contract.LOGITS, *presents}, "lanes KV")
        logits = next(o for o in self.session.get_outputs() if o.name == contract.LOGITS)
        self.vocab_size = logits.shape[1]
        self._bindings: OrderedDict[tuple[int, int], tuple[ort.IOBinding, list]] = OrderedDict()

    def execute(self, batch: StepBatch) -> np.ndarray:
        lanes = [self.lane_of(table) for table in batch.block_tables]
        calls = plan_calls(lanes, batch.query_lens, batch.context_lens, self.lane_tokens)
        if len(calls) == 1:
            return self._run(batch, lanes)
        parts = [(rows, self._run(sub, [lanes[i] for i in seqs])) for seqs in calls
                 for sub, rows in [select_sequences(batch, seqs)]]
        logits = np.empty((batch.logits_indices.size, parts[0][1].shape[1]), dtype=np.float32)
        for rows, part in parts:
            logits[rows] = part
        return logits

    def _run(self, batch: StepBatch, lanes: list[int]) -> np.ndarray:
        """One graph call over the lanes min(lanes) .. max(lanes)."""
        lo = min(lanes)
        binding = self._binding(lo, max(lanes) + 1)
        for name, array in lane_inputs(batch, [lane - lo for lane in lanes],
                                       max(lanes) + 1 - lo).items():
            binding.bind_cpu_input(name, array)
        # ONNX Runtime writes the logits straight into this array: no copy after the run.
        logits = np.empty((max(1, batch.logits_indices.size), self.vocab_size), np.float32)
        binding.bind_ortvalue_output(contract.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        self.session.run_with_iobinding(binding)
        return logits[: batch.logits_indices.size]

    def _binding(self, lo: int, hi: int) -> ort.IOBinding:
        """An IOBinding with lanes lo..hi-1 of every pool bound as past and present."""
        key = (lo, hi)
        if key in self._bindings:
            self._bindings.move_to_end(key)
            return self._bindings[key][0]
        binding, values = self.session.io_binding(), []
        for name, pool in self.pools.items():
            value = ort.OrtValue.ortvalue_from_numpy(pool[lo:hi])  # a view: no copy
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(contract.present_of(name), value)
            values.append(value)
        self._bindings[key] = (binding, values)
        if len(self._bindings) > MAX_BINDINGS:
            self._bindings.popitem(last=False)
        return binding


def plan_calls(lanes: list[int], query_lens: list[int], context_lens: list[int],
               capacity: int, free_rows: int = 32) -> list[list[int]]:
    """Sequences (by index) grouped into graph calls: query lengths grouped as for the
    blocks layout (`padding_groups`), then split where the idle lanes between two members
    would cost more than `free_rows` padded rows (an idle row still passes the matmuls).
    A row whose context plus the call's padded width would overrun its lane's `capacity`
    (ONNX Runtime checks the padded chunk) runs alone."""
    calls = []
    for group in padding_groups(query_lens):
        width = max(query_lens[i] for i in group)
        fits = sorted((i for i in group if context_lens[i] + width <= capacity),
                      key=lanes.__getitem__)
        calls += [[i] for i in group if i not in fits]
        run = [fits[0]]
        for i in fits[1:]:
            if (lanes[i] - lanes[run[-1]] - 1) * width > free_rows:
                calls.append(run)
                run = []
            run.append(i)
        calls.append(run)
    return calls


def lane_inputs(batch: StepBatch, rows: list[int], num_rows: int) -> dict[str, np.ndarray]:
    """The lanes contract's small inputs: sequence b of `batch` is row rows[b] of
    `num_rows`; the other rows are idle (no valid query token, nothing written)."""
    width = max(batch.query_lens)
    input_ids = np.zeros((num_rows, width), dtype=np.int64)
    query_seqlens = np.zeros(num_rows, dtype=np.int32)
    seqlens_k = np.zeros(num_rows, dtype=np.int32)
    padded_rows = []
    for row, tokens, context in zip(rows, batch.token_ids, batch.context_lens, strict=True):
        input_ids[row, : len(tokens)] = tokens
        query_seqlens[row] = len(tokens)
        seqlens_k[row] = context + len(tokens) - 1
        padded_rows.append(row * width + np.arange(len(tokens)))
    # Packed row r is padded row padded[r]. An empty request asks for one garbage row so
    # that no graph sees a zero-sized Gather; it is sliced off after the run.
    padded = np.concatenate(padded_rows)
    logits_rows = batch.logits_indices if batch.logits_indices.size else np.zeros(1, np.int64)
    return {
        contract.INPUT_IDS: input_ids,
        contract.QUERY_SEQLENS: query_seqlens,
        contract.SEQLENS_K: seqlens_k,
        contract.TOTAL_SEQUENCE_LENGTH: np.asarray(max(int(seqlens_k.max()) + 1, width),
                                                   dtype=np.int32),
        contract.LOGITS_INDICES: padded[logits_rows],
    }
