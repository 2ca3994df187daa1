"""OrtExecutor: runs the artifact's paged-KV graph with ONNX Runtime and owns the KV pool.

The pool is one numpy array per layer per cache tensor, shaped
[num_blocks, block_size, *slot_shape] in the manifest's dtype. It is bound to the graph
through OrtValues that share its memory, so a step never copies it; after the graph
runs, the step's `new.{i}.{t}` outputs are written into it at the slot mapping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmopt.runtime import contract
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.paging import cdiv, step_blocks
from llmopt.runtime.kv.sink_store import SinkStore
from llmopt.runtime.kv.tail_store import TailStore
from llmopt.runtime.manifest import KVCacheSpec

OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class OrtExecutor:
    def __init__(
        self,
        graph_path: str | Path,
        kv_cache: KVCacheSpec,
        *,
        num_blocks: int,
        block_size: int,
        max_position: int,
        num_threads: int | None = None,
        optimization_level: str = "all",
        nbits_accuracy_level: int = 0,
    ):
        self.block_size = block_size
        self.max_position = max_position
        self.session = open_session(graph_path, num_threads, optimization_level,
                                    nbits_accuracy_level)
        self.pools: dict[str, np.ndarray] = {}  # past name -> pool array
        self.new_to_past: dict[str, str] = {}  # graph output -> the pool it is written into
        self.block_to_past: dict[str, str] = {}  # ... for per-block tensors (whole blocks)
        for i, layer in enumerate(kv_cache.layers):
            for t in layer.tensors:
                past = contract.past_name(i, t.name)
                if t.per == "block":
                    self.pools[past] = np.zeros((num_blocks, *t.slot_shape), dtype=t.dtype)
                    self.block_to_past[contract.new_block_name(i, t.name)] = past
                    continue
                shape = (num_blocks, block_size, *t.slot_shape)
                self.pools[past] = np.zeros(shape, dtype=t.dtype)
                self.new_to_past[contract.new_name(i, t.name)] = past
        # What quantized layers keep unrounded beside the pool, by block (see contract).
        self.sinks, self.tails = SinkStore(kv_cache), TailStore(kv_cache)
        extra_inputs = ([*self.sinks.arrays, contract.SINK_ROWS] if self.sinks else []) + (
            [*self.tails.arrays, contract.TAIL_ROWS] if self.tails else [])
        self.output_names = [contract.LOGITS, *self.new_to_past, *self.block_to_past,
                             *self.sinks.new_to_store, *self.tails.new_to_store]
        check_graph_io(self.session, {contract.INPUT_IDS, contract.POSITION_IDS,
                                      contract.BLOCK_TABLES, contract.CONTEXT_LENS,
                                      contract.LOGITS_INDICES, *self.pools, *extra_inputs},
                       set(self.output_names), "paged-KV")
        # One binding for the executor's life: the pools are bound once, as OrtValues over
        # the arrays' own memory (binding copies nothing); a step rebinds the contract's
        # small inputs and its outputs (whose shapes change from step to step).
        self.binding = self.session.io_binding()
        for name, array in {**self.pools, **self.sinks.arrays, **self.tails.arrays}.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        # Flat [slots, *slot_shape] views of the pools, by the graph output written there.
        self.flat_pools = {
            new: self.pools[past].reshape(-1, *self.pools[past].shape[2:])
            for new, past in self.new_to_past.items()
        }

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block of every pool tensor (lanes: a prefix hit held by another lane)."""
        for pool in self.pools.values():
            pool[destination] = pool[source]
        self.sinks.copy_block(source, destination)

    def forget_block(self, block_id: int) -> None:
        """The block pool hands `block_id` out again: what was kept for it is stale."""
        self.sinks.forget_block(block_id)
        self.tails.forget_block(block_id)

    def release_block(self, block_id: int) -> None:
        """No sequence holds `block_id` any more: nobody will continue filling it."""
        self.tails.forget_block(block_id)

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run the step as few right-padded graph calls as keep padding waste small.

        One [B, S] call for a decode row beside a 512-token prefill chunk would compute
        512 rows for that decode; grouping by query length avoids it.
        """
        groups = padding_groups(batch.query_lens)
        if len(groups) == 1:
            return self._run(batch)
        parts = [(rows, self._run(sub)) for sub, rows in
                 (select_sequences(batch, seqs) for seqs in groups)]
        logits = np.empty((batch.logits_indices.size, parts[0][1].shape[1]), dtype=np.float32)
        for rows, part in parts:
            logits[rows] = part
        return logits

    def _run(self, batch: StepBatch) -> np.ndarray:
        inputs, slots = contract_inputs(batch, self.block_size, self.max_position)
        if self.sinks:
            inputs[contract.SINK_ROWS] = rows = self.sinks.rows_for(
                [table[0] for table in batch.block_tables])
        if self.tails:
            inputs[contract.TAIL_ROWS] = self.tails.rows_continued(
                batch.block_tables, inputs[contract.CONTEXT_LENS])
        self._bind_grown_stores()
        for name, array in inputs.items():
            self.binding.bind_cpu_input(name, array)
        self.binding.clear_binding_outputs()
        for name in self.output_names:
            self.binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(self.binding)
        outputs = dict(zip(self.output_names, self.binding.copy_outputs_to_cpu(), strict=True))

        keep = slots >= 0  # padded query rows are garbage and never written
        kept_slots = slots[keep]
        for name, flat_pool in self.flat_pools.items():
            new = outputs[name]
            flat_pool[kept_slots] = new.reshape(-1, *flat_pool.shape[1:])[keep]
        context_lens, query_lens = inputs[contract.CONTEXT_LENS], np.asarray(batch.query_lens)
        if self.block_to_past:
            self._write_blocks(outputs, batch.block_tables, context_lens, query_lens)
        if self.sinks:
            self.sinks.write(outputs, rows, context_lens, query_lens)
        if self.tails:
            self.tails.write(outputs, batch.block_tables, context_lens, query_lens)
        logits = outputs[contract.LOGITS]
        return logits[: batch.logits_indices.size].astype(np.float32, copy=False)

    def _write_blocks(self, outputs: dict[str, np.ndarray], block_tables: list[list[int]],
                      context_lens: np.ndarray, query_lens: np.ndarray) -> None:
        """Write each sequence's step blocks (from the one it continued) that it reached."""
        seqs, steps, block_ids = step_blocks(block_tables, context_lens, query_lens,
                                             self.block_size)
        for name, past in self.block_to_past.items():
            self.pools[past][block_ids] = outputs[name][seqs, steps]

    def _bind_grown_stores(self) -> None:
        for store in (self.sinks, self.tails):
            if store.grown:  # the store reallocated its arrays: bind the new ones
                for name, array in store.arrays.items():
                    self.binding.bind_ortvalue_input(name,
                                                     ort.OrtValue.ortvalue_from_numpy(array))
                store.grown = False


def padding_groups(query_lens: list[int], max_waste: float = 0.25,
                   free_rows: int = 32) -> list[list[int]]:
    """Partition sequences (by index) into groups whose right-padded [B, S] call wastes at
    most `max_waste` of its rows, or at most `free_rows` rows: longest first, greedily.

    Each call reads every weight once, which costs about as much as computing a few dozen
    rows: padding a speculative decode's one 6-token verification and its neighbours'
    1-token steps into one call is far cheaper than a second call.
    """
    order = sorted(range(len(query_lens)), key=lambda i: -query_lens[i])
    groups: list[list[int]] = []
    real = 0
    for index in order:
        if groups:
            longest = query_lens[groups[-1][0]]
            padded = longest * (len(groups[-1]) + 1)
            real_after = real + query_lens[index]
            if padded <= (1 + max_waste) * real_after or padded - real_after <= free_rows:
                groups[-1].append(index)
                real = real_after
                continue
        groups.append([index])
        real = query_lens[index]
    return groups


def select_sequences(batch: StepBatch, seqs: list[int]) -> tuple[StepBatch, np.ndarray]:
    """The sub-batch of sequences `seqs`, and which of `batch`'s logits rows it returns."""
    starts, lens = batch.query_start, batch.query_lens
    packed = np.concatenate([np.arange(starts[s], starts[s] + lens[s]) for s in seqs])
    new_row = np.full(int(sum(lens)), -1, dtype=np.int64)
    new_row[packed] = np.arange(packed.size)
    mine = np.flatnonzero(new_row[batch.logits_indices] >= 0)
    sub_batch = StepBatch(
        token_ids=[batch.token_ids[s] for s in seqs],
        context_lens=[batch.context_lens[s] for s in seqs],
        block_tables=[batch.block_tables[s] for s in seqs],
        slot_mapping=batch.slot_mapping[packed],
        logits_indices=new_row[batch.logits_indices[mine]],
    )
    return sub_batch, mine


def open_session(graph_path: str | Path, num_threads: int | None, optimization_level: str,
                 nbits_accuracy_level: int) -> ort.InferenceSession:
    """A CPU session for an artifact graph (both KV layouts' executors open theirs here)."""
    return ort.InferenceSession(
        str(graph_path),
        session_options(num_threads, optimization_level, nbits_accuracy_level),
        providers=["CPUExecutionProvider"],
    )


def session_options(
    num_threads: int | None, optimization_level: str, nbits_accuracy_level: int = 0
) -> ort.SessionOptions:
    if optimization_level not in OPTIMIZATION_LEVELS:
        raise ValueError(
            f"unknown graph optimization level {optimization_level!r}; "
            f"expected one of {sorted(OPTIMIZATION_LEVELS)}"
        )
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads or 0  # 0: ONNX Runtime picks (physical cores)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = OPTIMIZATION_LEVELS[optimization_level]
    # ONNX Runtime fuses DequantizeLinear → MatMul into MatMulNBits with int8 activations
    # (accuracy level 4) unless told otherwise: keep the artifact's own choice.
    options.add_session_config_entry(
        "session.qdq_matmulnbits_accuracy_level", str(nbits_accuracy_level)
    )
    return options


def contract_inputs(
    batch: StepBatch, block_size: int, max_position: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The contract's right-padded inputs for `batch` and its padded [B*S] slot mapping.

    Padding slots are -1: those rows are never written into the pool.
    """
    query_lens = np.asarray(batch.query_lens, dtype=np.int64)
    context_lens = np.asarray(batch.context_lens, dtype=np.int64)
    num_seqs, max_query = batch.num_seqs, int(query_lens.max())
    valid = np.arange(max_query)[None, :] < query_lens[:, None]  # [B, S], row-major = packed

    input_ids = np.zeros((num_seqs, max_query), dtype=np.int64)
    input_ids[valid] = np.concatenate(batch.token_ids)
    # Padded rows continue their sequence's positions, so a graph that masks the step's
    # own keys by position or by index treats them alike; clipped to stay in the rotary table.
    position_ids = np.minimum(context_lens[:, None] + np.arange(max_query), max_position - 1)
    slots = np.full((num_seqs, max_query), -1, dtype=np.int64)
    slots[valid] = batch.slot_mapping

    # The graph gathers only the blocks that hold cached context; the step's own keys and
    # values come from the step itself.
    num_table_blocks = max(1, max(cdiv(int(c), block_size) for c in context_lens))
    block_tables = np.full((num_seqs, num_table_blocks), contract.NULL_BLOCK, dtype=np.int64)
    for b, table in enumerate(batch.block_tables):
        used = table[:num_table_blocks]
        block_tables[b, : len(used)] = used

    # Packed row r is padded row padded_rows[r]. An empty request asks for one garbage row
    # so that no graph ever sees a zero-sized Gather; it is sliced off after the run.
    padded_rows = np.flatnonzero(valid)
    logits_rows = batch.logits_indices if batch.logits_indices.size else np.zeros(1, np.int64)
    inputs = {
        contract.INPUT_IDS: input_ids,
        contract.POSITION_IDS: position_ids,
        contract.BLOCK_TABLES: block_tables,
        contract.CONTEXT_LENS: context_lens,
        contract.LOGITS_INDICES: padded_rows[logits_rows],
    }
    return inputs, slots.ravel()


def check_graph_io(session: ort.InferenceSession, inputs: set[str], outputs: set[str],
                   contract_name: str) -> None:
    """Fail loudly when the graph's inputs are not exactly `inputs` or it lacks one of
    `outputs` (the contract of the manifest's KV layout)."""
    got_inputs = {i.name for i in session.get_inputs()}
    got_outputs = {o.name for o in session.get_outputs()}
    if got_inputs != inputs or not outputs <= got_outputs:
        raise ValueError(
            f"the graph does not follow the {contract_name} contract for this manifest: "
            f"missing inputs {sorted(inputs - got_inputs)}, "
            f"unexpected inputs {sorted(got_inputs - inputs)}, "
            f"missing outputs {sorted(outputs - got_outputs)}"
        )
