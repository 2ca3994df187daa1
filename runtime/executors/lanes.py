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
from llmopt.runtime.executors.inputs import lane_inputs
from llmopt.runtime.executors.ort import check_graph_io, open_session, padding_groups, run_calls
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.pools import LanePools

MAX_BINDINGS = 32  # lane ranges whose pool bindings are kept ready


class LaneExecutor:
    def __init__(
        self,
        graph_path: str | Path,
        pools: LanePools,
        *,
        num_threads: int | None = None,
        optimization_level: str = "all",
        nbits_accuracy_level: int = 0,
    ):
        self.pools = pools
        self.session = open_session(graph_path, num_threads, optimization_level,
                                    nbits_accuracy_level)
        presents = {contract.present_of(name) for name in pools}
        check_graph_io(self.session, {contract.INPUT_IDS, contract.QUERY_SEQLENS,
                                      contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH,
                                      contract.LOGITS_INDICES, *pools},
                       {contract.LOGITS, *presents}, "lanes KV")
        logits = next(o for o in self.session.get_outputs() if o.name == contract.LOGITS)
        self.vocab_size = logits.shape[1]
        self._bindings: OrderedDict[tuple[int, int], tuple[ort.IOBinding, list]] = OrderedDict()
        self._sums: np.ndarray | None = None  # accumulate_attention's

    def accumulate_attention(self, sums: np.ndarray) -> None:
        """Every step adds each token's attention weights to `sums` [layers, lanes, kv_heads,
        lane_tokens] float32 (H2O's accumulated attention: `kv.h2o`), from the graph's
        `attention_sums` outputs, which a graph compiled for H2O has."""
        outputs = {o.name for o in self.session.get_outputs()}
        layers = self.pools.num_layers
        if any(contract.attention_sums_name(i) not in outputs for i in range(layers)):
            raise ValueError("h2o on ONNX Runtime needs a graph that returns its attention "
                             "weights: compile the artifact with `runtime: {h2o: ...}` (or "
                             "run the native step)")
        if (sums.dtype != np.float32 or sums.shape[:2] != (layers, self.pools.num_lanes)
                or sums.shape[3] != self.pools.lane_tokens):
            raise ValueError(f"attention sums {sums.shape} {sums.dtype} do not match the lanes")
        self._sums = sums

    @property
    def lane_blocks(self) -> int:
        """Blocks per lane (a caller without a manager lays its block tables by lanes)."""
        return self.pools.lane_blocks

    def execute(self, batch: StepBatch) -> np.ndarray:
        lanes = [self.pools.lane_of(table) for table in batch.block_tables]
        calls = plan_calls(lanes, batch.query_lens, batch.context_lens, self.pools.lane_tokens)
        return run_calls(batch, calls, lambda sub, seqs: self._run(sub, [lanes[i] for i in seqs]))

    def _run(self, batch: StepBatch, lanes: list[int]) -> np.ndarray:
        """One graph call over the lanes min(lanes) .. max(lanes)."""
        lo = min(lanes)
        binding = self._binding(lo, max(lanes) + 1)
        inputs = lane_inputs(batch, [lane - lo for lane in lanes], max(lanes) + 1 - lo)
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        # ONNX Runtime writes the logits straight into this array: no copy after the run.
        logits = np.empty((max(1, batch.logits_indices.size), self.vocab_size), np.float32)
        binding.bind_ortvalue_output(contract.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        step_sums = None
        if self._sums is not None:  # each layer's [rows, kv_heads, total length], added below
            total = int(inputs[contract.TOTAL_SEQUENCE_LENGTH])
            step_sums = np.empty((self._sums.shape[0], max(lanes) + 1 - lo,
                                  self._sums.shape[2], total), np.float32)
            for i, layer in enumerate(step_sums):
                binding.bind_ortvalue_output(contract.attention_sums_name(i),
                                             ort.OrtValue.ortvalue_from_numpy(layer))
        self.session.run_with_iobinding(binding)
        if step_sums is not None:  # idle rows add exact zeros
            self._sums[:, lo:max(lanes) + 1, :, :step_sums.shape[3]] += step_sums
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
