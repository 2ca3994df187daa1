"""NativeLaneExecutor: the lanes contract run by one native call per step."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from llmopt.runtime.executors.inputs import native_inputs
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.pools import LanePools
from llmopt.runtime.manifest import GraphSpec
from llmopt.runtime.native.library import kernels
from llmopt.runtime.native.plan import NativePlan, read_plan
from llmopt.runtime.native.threads import ADAPTIVE_VARIABLE, ThreadGovernor
from llmopt.runtime.native.weights import NativeWeights


class NativeLaneExecutor:
    """For a graph `runs_native` (runtime/executors/choose.py) accepted: its plan over its
    KV lanes (float32, or the int8/int4 codes the plan names per layer)."""

    tree_attention = True  # runs trees of query tokens (StepBatch.query_parents)

    def __init__(self, artifact: Path, graph: GraphSpec, pools: LanePools, *,
                 num_threads: int | None = None, max_position: int):
        self.pools = pools
        threads = num_threads or os.cpu_count() or 1
        plan = read_plan(graph.native)
        assert isinstance(plan, NativePlan), "runs_native accepted a graph without a plan"
        self.weights = NativeWeights(plan, artifact / graph.data_file, threads, max_position)
        self.vocab_size = plan.vocab
        self.window = plan.window
        layers = pools.num_layers
        self._keys = (ctypes.c_void_p * layers)(
            *(pools[f"past.{i}.key"].ctypes.data for i in range(layers)))
        self._values = (ctypes.c_void_p * layers)(
            *(pools[f"past.{i}.value"].ctypes.data for i in range(layers)))
        self._lib = kernels()
        self._sums: ctypes.Array | None = None  # accumulate_attention's, per layer
        self.governor = ThreadGovernor(threads, os.environ.get(ADAPTIVE_VARIABLE, "1") != "0")

    @property
    def lane_blocks(self) -> int:
        """Blocks per lane (a caller without a manager lays its block tables by lanes)."""
        return self.pools.lane_blocks

    def move_entries(self, block_table: list[int], sources: list[int],
                     destinations: list[int]) -> None:
        """Move an accepted tree branch's entries (see `LanePools.move_entries`)."""
        self.pools.move_entries(block_table, sources, destinations)

    def accumulate_attention(self, sums: np.ndarray) -> None:
        """Every step adds each token's attention weights to `sums` [layers, lanes, kv_heads,
        lane_tokens] float32 (H2O's accumulated attention: `kv.h2o`)."""
        layers, lanes, kv_heads, lane_tokens = sums.shape
        if (sums.dtype != np.float32 or not sums.flags.c_contiguous or lanes != self.pools.num_lanes
                or lane_tokens != self.pools.lane_tokens or layers != self.pools.num_layers):
            raise ValueError(f"attention sums {sums.shape} {sums.dtype} do not match the lanes")
        self._sums = (ctypes.c_void_p * layers)(*(sums[i].ctypes.data for i in range(layers)))
        self._sums_array = sums  # keeps the memory the pointers name alive

    def execute(self, batch: StepBatch) -> np.ndarray:
        step = native_inputs(batch, [self.pools.lane_of(table) for table in batch.block_tables])
        positions = step.positions
        if positions.size and positions.max() >= self.weights.model.max_position:
            raise ValueError(f"position {positions.max()} is past the rotary table")
        if step.masks is not None and self.window is not None:
            check_tree_window(batch, positions, self.window)
        rows = step.logits_rows
        logits = np.empty((rows.size, self.vocab_size), np.float32)
        threads = self.weights.model.num_threads = self.governor.choose(step.tokens.size)
        started = time.perf_counter()
        args = (ctypes.byref(self.weights.model), step.tokens.size, step.tokens.ctypes.data,
                step.token_lanes.ctypes.data, positions.ctypes.data, step.lane_rows.ctypes.data,
                None if step.masks is None else step.masks.ctypes.data, self._keys,
                self._values, self.pools.lane_tokens, rows.size, rows.ctypes.data,
                logits.ctypes.data)
        status = (self._lib.llmopt_forward(*args) if self._sums is None
                  else self._lib.llmopt_forward_scored(*args, self._sums))
        self.governor.observe(step.tokens.size, threads, time.perf_counter() - started)
        if status:
            raise MemoryError("the native step could not allocate its scratch memory")
        return logits


def check_tree_window(batch: StepBatch, positions: np.ndarray, window: int) -> None:
    """A draft tree's token sees its context by position and its ancestors by the tree
    mask: exact while no token lies a window or more past its sequence's context."""
    contexts = np.repeat(np.asarray(batch.context_lens), [len(seq) for seq in batch.token_ids])
    depth = int((positions - contexts).max())
    if depth >= window:
        raise ValueError(f"a draft tree {depth + 1} tokens deep does not fit the sliding "
                         f"window of {window} (draft fewer tokens a step)")
