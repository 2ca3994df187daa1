"""StepBatch: what one engine step hands a model executor, and the Executor protocol.

Sequences are packed: sequence b's query tokens are the rows
`query_start[b] .. query_start[b] + query_lens[b] - 1` of the step, and `slot_mapping`
and `logits_indices` index those packed rows. Each executor turns this into its own
layout (OrtExecutor: the right-padded [B, S] tensors of the paged-KV contract).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llmopt.runtime.paging import slots_of


@dataclass(frozen=True)
class StepBatch:
    token_ids: list[list[int]]  # query tokens of each sequence
    context_lens: list[int]  # tokens of each sequence already in the pool = its first position
    block_tables: list[list[int]]  # physical block ids of each sequence, covering its query
    slot_mapping: np.ndarray  # int64 [T]: pool slot of each packed query token
    logits_indices: np.ndarray  # int64 [N]: packed query rows whose logits are returned

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def query_lens(self) -> list[int]:
        return [len(tokens) for tokens in self.token_ids]

    @property
    def query_start(self) -> np.ndarray:
        """int64 [B]: packed row of each sequence's first query token."""
        return np.concatenate([[0], np.cumsum(self.query_lens)[:-1]]).astype(np.int64)


class Executor(Protocol):
    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run one step: write its KV into the pool, return float32 logits [N, vocab]."""
        ...

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's entries of every pool tensor."""
        ...


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's share of a step."""

    token_ids: list[int]  # its query tokens
    start: int  # position of the first = its tokens already in the pool
    block_table: list[int]  # physical block ids covering positions 0 .. start + len - 1
    logits_offsets: Sequence[int]  # query offsets whose logits the step returns


def make_step_batch(sequences: Sequence[SequenceStep], block_size: int) -> StepBatch:
    """The one StepBatch builder (engine, model drafter, compile-time measurement):
    logits rows follow `sequences`' order."""
    slots, logits_indices, row = [], [], 0
    for seq in sequences:
        slots.append(slots_of(seq.block_table, seq.start, len(seq.token_ids), block_size))
        logits_indices.extend(row + offset for offset in seq.logits_offsets)
        row += len(seq.token_ids)
    return StepBatch(
        token_ids=[seq.token_ids for seq in sequences],
        context_lens=[seq.start for seq in sequences],
        block_tables=[seq.block_table for seq in sequences],
        slot_mapping=np.concatenate(slots).astype(np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
    )
