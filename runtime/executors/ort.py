"""ONNX Runtime plumbing both ONNX Runtime executors share: sessions, the graph's contract
check, and a step split into graph calls."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmopt.runtime.executors.step_batch import StepBatch

OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


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


def padding_groups(query_lens: list[int], max_waste: float = 0.25,
                   free_rows: int = 32) -> list[list[int]]:
    """Partition sequences (by index) into groups whose right-padded [B, S] call wastes at
    most `max_waste` of its rows, or at most `free_rows` rows: longest first, greedily.

    Each call reads every weight once, which costs about as much as computing a few dozen
    rows: padding one sequence's 6-token step and its neighbours' 1-token steps into one
    call is far cheaper than a second call.
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
        local_block_tables=(None if batch.local_block_tables is None
                            else [batch.local_block_tables[s] for s in seqs]),
        local_slot_mapping=(None if batch.local_slot_mapping is None
                            else batch.local_slot_mapping[packed]),
    )
    return sub_batch, mine


def run_calls(batch: StepBatch, calls: list[list[int]],
              run: Callable[[StepBatch, list[int]], np.ndarray]) -> np.ndarray:
    """The step's logits from one graph call per group of sequences in `calls` (`run`
    takes a sub-batch and its sequences' indices), in `batch`'s logits order."""
    if len(calls) == 1:  # the batch itself, its sequences in order
        return run(batch, list(range(batch.num_seqs)))
    parts = [(rows, run(sub, seqs)) for seqs in calls
             for sub, rows in [select_sequences(batch, seqs)]]
    logits = np.empty((batch.logits_indices.size, parts[0][1].shape[1]), dtype=np.float32)
    for rows, part in parts:
        logits[rows] = part
    return logits
