"""StepBatch: what one engine step hands a model executor, and the Executor protocol.

Sequences are packed: sequence b's query tokens are the rows
`query_start[b] .. query_start[b] + query_lens[b] - 1` of the step, and `slot_mapping`
and `logits_indices` index those packed rows. Each executor turns this into its own
layout through `executors.inputs` (the blocks contract's right-padded [B, S] tensors, a
row per lane, the native step's packed per-token arrays).

A sequence's query tokens normally continue each other. In a tree of query tokens
(`query_parents`) a token follows its parent instead: it sits at the position after
its parent's (`positions`), sees the pool's entries and its own ancestors in the step
(`tree_masks`), and is written to the next slot in query order like any other, so
siblings get different slots; an executor that can run this says `tree_attention`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llmopt.runtime.kv.paging import slots_of


@dataclass(frozen=True)
class StepBatch:
    token_ids: list[list[int]]  # query tokens of each sequence
    context_lens: list[int]  # tokens of each sequence already in the pool = its first position
    block_tables: list[list[int]]  # physical block ids of each sequence, covering its query
    slot_mapping: np.ndarray  # int64 [T]: pool slot of each packed query token
    logits_indices: np.ndarray  # int64 [N]: packed query rows whose logits are returned
    # Per sequence, the query offset of each query token's parent (-1: the pool's last
    # entry); None for a sequence whose tokens continue each other. None: no trees.
    query_parents: list[list[int] | None] | None = None
    # The sliding-window layers' own block tables and slots (`kv.sliding`); None: none.
    local_block_tables: list[list[int]] | None = None
    local_slot_mapping: np.ndarray | None = None

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

    def positions(self) -> np.ndarray:
        """int32 [T]: each packed query token's position: its sequence's context plus its
        depth in the step (its offset, unless it is in a tree)."""
        parents = self.query_parents or [None] * self.num_seqs
        return np.concatenate([
            start + (np.arange(len(tokens)) if tree is None else tree_depths(tree))
            for start, tokens, tree in zip(self.context_lens, self.token_ids, parents,
                                           strict=True)]).astype(np.int32)

    def tree_masks(self) -> np.ndarray:
        """uint64 [T]: bit j of token t says whether the query token j slots before it
        (in query order) is visible to it: its own sequence's earlier pool entries and its
        ancestors are, its tree's other branches are not. All ones without a tree; trees
        hold at most 64 tokens."""
        masks = np.full(len(self.slot_mapping), np.iinfo(np.uint64).max, np.uint64)
        for start, tree in zip(self.query_start, self.query_parents or [], strict=False):
            if tree is not None:
                masks[start:start + len(tree)] = ancestor_masks(tree)
        return masks


def tree_depths(parents: Sequence[int]) -> np.ndarray:
    """Each query token's offset from its sequence's context along its ancestors: a chain's
    are 0, 1, 2, ...; siblings share one."""
    depths = np.zeros(len(parents), np.int64)
    for i, parent in enumerate(parents):
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return depths


MAX_TREE_TOKENS = 64  # a sequence's query tokens a tree mask covers (one uint64 each)


def ancestor_masks(parents: Sequence[int]) -> np.ndarray:
    """uint64 per query token: bit j set when the token j offsets before it is itself or
    an ancestor, or lies before the tree (offsets below 0); parents come first."""
    if len(parents) > MAX_TREE_TOKENS:
        raise ValueError(f"a tree of {len(parents)} query tokens is over the "
                         f"{MAX_TREE_TOKENS} a step's tree mask holds")
    masks: list[int] = []
    for i, parent in enumerate(parents):
        before = ~((1 << (i + 1)) - 1) & 0xFFFF_FFFF_FFFF_FFFF  # rows before the tree
        seen = 1 << 0  # itself
        node = parent
        while node >= 0:
            seen |= 1 << (i - node)
            node = parents[node]
        masks.append(seen | before)
    return np.asarray(masks, dtype=np.uint64)


class Executor(Protocol):
    pools: Mapping[str, np.ndarray]  # the KV pools it reads and writes (`kv.pools`)

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run one step: write its KV into the pool, return float32 logits [N, vocab]."""
        ...


class TreeExecutor(Executor, Protocol):
    """An executor that runs trees of query tokens (`StepBatch.query_parents`)."""

    tree_attention: bool

    def move_entries(self, block_table: list[int], sources: list[int],
                     destinations: list[int]) -> None:
        """Copy a sequence's pool entries at positions `sources` to `destinations` (an
        accepted tree branch into the positions its tokens now have)."""
        ...


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's share of a step."""

    token_ids: list[int]  # its query tokens
    start: int  # position of the first = its tokens already in the pool
    block_table: list[int]  # physical block ids covering positions 0 .. start + len - 1
    logits_offsets: Sequence[int]  # query offsets whose logits the step returns
    parents: list[int] | None = None  # each query token's parent offset; None: a chain
    local_block_table: list[int] | None = None  # the sliding-window layers' table, if any


def make_step_batch(sequences: Sequence[SequenceStep], block_size: int) -> StepBatch:
    """The one StepBatch builder (the engine's steps, a second graph's, compile-time
    measurement): logits rows follow `sequences`' order. Slots stay Python ints until one
    array at the end: at decode, numpy calls per sequence cost more than their
    arithmetic."""
    slots: list[int] = []
    local = sequences[0].local_block_table is not None if sequences else False
    local_slots: list[int] = []
    logits_indices: list[int] = []
    row = 0
    for seq in sequences:
        slots += slots_of(seq.block_table, seq.start, len(seq.token_ids), block_size)
        if local:
            local_slots += slots_of(seq.local_block_table, seq.start, len(seq.token_ids),
                                    block_size)
        logits_indices += [row + offset for offset in seq.logits_offsets]
        row += len(seq.token_ids)
    return StepBatch(
        token_ids=[seq.token_ids for seq in sequences],
        context_lens=[seq.start for seq in sequences],
        block_tables=[seq.block_table for seq in sequences],
        slot_mapping=np.asarray(slots, dtype=np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
        query_parents=([seq.parents for seq in sequences]
                       if any(seq.parents is not None for seq in sequences) else None),
        local_block_tables=[seq.local_block_table for seq in sequences] if local else None,
        local_slot_mapping=np.asarray(local_slots, dtype=np.int64) if local else None,
    )
