"""NativeLaneExecutor: the lanes contract run by one native call per step."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from llmopt.runtime.executors.lanes import LanePools
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.manifest import GraphSpec, KVCacheSpec
from llmopt.runtime.native.library import kernels
from llmopt.runtime.native.weights import NativeWeights


class NativeLaneExecutor(LanePools):
    """For a graph `runs_native` (runtime/assembly.py) accepted: its plan and its KV lanes
    (float32, or the int8/int4 codes the plan names per layer)."""

    tree_attention = True  # runs draft trees (StepBatch.query_parents)

    def __init__(self, artifact: Path, graph: GraphSpec, kv_cache: KVCacheSpec, *,
                 num_blocks: int, block_size: int, lane_blocks: int,
                 num_threads: int | None = None, max_position: int):
        super().__init__(kv_cache, num_blocks=num_blocks, block_size=block_size,
                         lane_blocks=lane_blocks)
        threads = num_threads or os.cpu_count() or 1
        self.weights = NativeWeights(graph.native, artifact / graph.data_file, threads,
                                     max_position)
        self.vocab_size = graph.native["vocab"]
        layers = len(kv_cache.layers)
        self._keys = (ctypes.c_void_p * layers)(
            *(self.pools[f"past.{i}.key"].ctypes.data for i in range(layers)))
        self._values = (ctypes.c_void_p * layers)(
            *(self.pools[f"past.{i}.value"].ctypes.data for i in range(layers)))
        self._lib = kernels()

    def execute(self, batch: StepBatch) -> np.ndarray:
        # Per-token lists in Python, one array each: numpy calls per sequence cost more
        # than the work at decode (session 31).
        lanes = [self.lane_of(table) for table in batch.block_tables]
        tokens = np.asarray([t for seq in batch.token_ids for t in seq], np.int64)
        token_lanes = np.asarray([lane for lane, seq in zip(lanes, batch.token_ids, strict=True)
                                  for _ in seq], np.int32)
        lane_rows = np.asarray([row for start, seq in
                                zip(batch.context_lens, batch.token_ids, strict=True)
                                for row in range(start, start + len(seq))], np.int32)
        positions, masks = lane_rows, None
        if batch.query_parents is not None:  # a tree's siblings share a position
            positions, masks = batch.positions(), batch.tree_masks()
        if positions.size and positions.max() >= self.weights.model.max_position:
            raise ValueError(f"position {positions.max()} is past the rotary table")
        rows = batch.logits_indices.astype(np.int32)
        logits = np.empty((rows.size, self.vocab_size), np.float32)
        status = self._lib.llmopt_forward(
            ctypes.byref(self.weights.model), tokens.size, tokens.ctypes.data,
            token_lanes.ctypes.data, positions.ctypes.data, lane_rows.ctypes.data,
            None if masks is None else masks.ctypes.data, self._keys, self._values,
            self.lane_tokens, rows.size, rows.ctypes.data, logits.ctypes.data)
        if status:
            raise MemoryError("the native step could not allocate its scratch memory")
        return logits
