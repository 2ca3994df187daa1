"""OrtExecutor: runs the artifact's paged-KV graph with ONNX Runtime and owns the KV pool.

The pool is one numpy array per layer per cache tensor, shaped
[num_blocks, block_size, *slot_shape] in the manifest's dtype. It is bound to the graph
through OrtValues that share its memory, so a step never copies it; after the graph
runs, the step's `new.{i}.{t}` outputs are written into it at the slot mapping.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from llmopt.runtime import contract
from llmopt.runtime.executors.inputs import contract_inputs, padded_slots, valid_rows
from llmopt.runtime.executors.ort import check_graph_io, open_session, padding_groups, run_calls
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.pools import BlockPools


class OrtExecutor:
    def __init__(
        self,
        graph_path: str | Path,
        pools: BlockPools,
        *,
        max_position: int,
        num_threads: int | None = None,
        optimization_level: str = "all",
        nbits_accuracy_level: int = 0,
    ):
        self.pools, self.block_size, self.max_position = pools, pools.block_size, max_position
        self.session = open_session(graph_path, num_threads, optimization_level,
                                    nbits_accuracy_level)
        sinks, tails = pools.sinks, pools.tails
        extra_inputs = ([*sinks.arrays, contract.SINK_ROWS] if sinks else []) + (
            [*tails.arrays, contract.TAIL_ROWS] if tails else [])
        self.output_names = [contract.LOGITS, *pools.new_to_past, *pools.block_to_past,
                             *sinks.new_to_store, *tails.new_to_store]
        if pools.local_flat:
            extra_inputs.append(contract.LOCAL_BLOCK_TABLES)
        check_graph_io(self.session, {contract.INPUT_IDS, contract.POSITION_IDS,
                                      contract.BLOCK_TABLES, contract.CONTEXT_LENS,
                                      contract.LOGITS_INDICES, *pools, *extra_inputs},
                       set(self.output_names), "paged-KV")
        # One binding for the executor's life: the pools are bound once, as OrtValues over
        # the arrays' own memory (binding copies nothing); a step rebinds the contract's
        # small inputs and its outputs (whose shapes change from step to step).
        self.binding = self.session.io_binding()
        for name, array in {**pools, **sinks.arrays, **tails.arrays}.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run the step as few right-padded graph calls as keep padding waste small.

        One [B, S] call for a decode row beside a 512-token prefill chunk would compute
        512 rows for that decode; grouping by query length avoids it.
        """
        if self.pools.local_flat and batch.local_block_tables is None:
            batch = self._full_tables_for_local(batch)
        return run_calls(batch, padding_groups(batch.query_lens), lambda sub, _: self._run(sub))

    def _full_tables_for_local(self, batch: StepBatch) -> StepBatch:
        """A step built without a KV manager's local tables (a measurement runner): every
        layer reads the full tables, which index the local pools too when they are as large."""
        if not self.pools.local_as_large:
            raise ValueError("this step has no local block tables, and the sliding-window "
                             "layers' pools are smaller than the full ones")
        return replace(batch, local_block_tables=batch.block_tables,
                       local_slot_mapping=batch.slot_mapping)

    def _run(self, batch: StepBatch) -> np.ndarray:
        inputs, slots = contract_inputs(batch, self.block_size, self.max_position)
        inputs.update(self.pools.store_inputs(batch.block_tables, inputs[contract.CONTEXT_LENS]))
        self._bind_grown_stores()
        for name, array in inputs.items():
            self.binding.bind_cpu_input(name, array)
        self.binding.clear_binding_outputs()
        for name in self.output_names:
            self.binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(self.binding)
        outputs = dict(zip(self.output_names, self.binding.copy_outputs_to_cpu(), strict=True))
        local_slots = None
        if batch.local_slot_mapping is not None:
            local_slots = padded_slots(batch.local_slot_mapping, valid_rows(batch))
        self.pools.write(outputs, inputs, slots, batch.block_tables,
                         np.asarray(batch.query_lens), local_slots)
        logits = outputs[contract.LOGITS]
        return logits[: batch.logits_indices.size].astype(np.float32, copy=False)

    def _bind_grown_stores(self) -> None:
        for store in (self.pools.sinks, self.pools.tails):
            if store.grown:  # the store reallocated its arrays: bind the new ones
                for name, array in store.arrays.items():
                    self.binding.bind_ortvalue_input(name,
                                                     ort.OrtValue.ortvalue_from_numpy(array))
                store.grown = False
