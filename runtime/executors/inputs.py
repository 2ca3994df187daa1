"""Every executor's inputs, built from the one step description (`StepBatch`, packed rows).

- `contract_inputs`: the "blocks" contract's right-padded [B, S] tensors (gathered blocks);
- `lane_inputs`: the "lanes" contract's rows, one per lane in the call;
- `native_inputs`: the native step's packed per-token arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.runtime import contract
from llmopt.runtime.executors.step_batch import StepBatch
from llmopt.runtime.kv.paging import cdiv


def logits_input(batch: StepBatch, padded_rows: np.ndarray) -> np.ndarray:
    """The padded rows whose logits the graph returns (`padded_rows[r]`: packed row r's).

    An empty request asks for one garbage row so that no graph ever sees a zero-sized
    Gather; it is sliced off after the run.
    """
    logits_rows = batch.logits_indices if batch.logits_indices.size else np.zeros(1, np.int64)
    return padded_rows[logits_rows]


def contract_inputs(
    batch: StepBatch, block_size: int, max_position: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The contract's right-padded inputs for `batch` and its padded [B*S] slot mapping.

    Padding slots are -1: those rows are never written into the pool.
    """
    query_lens = np.asarray(batch.query_lens, dtype=np.int64)
    context_lens = np.asarray(batch.context_lens, dtype=np.int64)
    num_seqs, max_query = batch.num_seqs, int(query_lens.max())
    valid = valid_rows(batch)  # [B, S], row-major = packed

    input_ids = np.zeros((num_seqs, max_query), dtype=np.int64)
    input_ids[valid] = np.concatenate(batch.token_ids)
    # Padded rows continue their sequence's positions, so a graph that masks the step's
    # own keys by position or by index treats them alike; clipped to stay in the rotary table.
    position_ids = np.minimum(context_lens[:, None] + np.arange(max_query), max_position - 1)

    # The graph gathers only the blocks that hold cached context; the step's own keys and
    # values come from the step itself.
    num_table_blocks = max(1, max(cdiv(int(c), block_size) for c in context_lens))
    padded_rows = np.flatnonzero(valid)  # packed row r is padded row padded_rows[r]
    inputs = {
        contract.INPUT_IDS: input_ids,
        contract.POSITION_IDS: position_ids,
        contract.BLOCK_TABLES: padded_tables(batch.block_tables, num_table_blocks),
        contract.CONTEXT_LENS: context_lens,
        contract.LOGITS_INDICES: logits_input(batch, padded_rows),
    }
    if batch.local_block_tables is not None:
        inputs[contract.LOCAL_BLOCK_TABLES] = padded_tables(batch.local_block_tables,
                                                           num_table_blocks)
    return inputs, padded_slots(batch.slot_mapping, valid)


def padded_tables(tables: list[list[int]], width: int) -> np.ndarray:
    """int64 [B, width]: each table's first `width` blocks, padded with the null block."""
    padded = np.full((len(tables), width), contract.NULL_BLOCK, dtype=np.int64)
    for b, table in enumerate(tables):
        used = table[:width]
        padded[b, : len(used)] = used
    return padded


def valid_rows(batch: StepBatch) -> np.ndarray:
    """bool [B, S]: which rows of the right-padded step hold a query token."""
    query_lens = np.asarray(batch.query_lens, dtype=np.int64)
    return np.arange(int(query_lens.max()))[None, :] < query_lens[:, None]


def padded_slots(slot_mapping: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """The packed slots laid out over the right-padded [B*S] rows; padding rows get -1."""
    slots = np.full(valid.shape, -1, dtype=np.int64)
    slots[valid] = slot_mapping
    return slots.ravel()


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
    padded = np.concatenate(padded_rows)  # packed row r is padded row padded[r]
    return {
        contract.INPUT_IDS: input_ids,
        contract.QUERY_SEQLENS: query_seqlens,
        contract.SEQLENS_K: seqlens_k,
        contract.TOTAL_SEQUENCE_LENGTH: np.asarray(max(int(seqlens_k.max()) + 1, width),
                                                   dtype=np.int32),
        contract.LOGITS_INDICES: logits_input(batch, padded),
    }


@dataclass(frozen=True)
class NativeInputs:
    """The native step's packed per-token arrays."""

    tokens: np.ndarray  # int64 [T]
    token_lanes: np.ndarray  # int32 [T]: each token's lane
    lane_rows: np.ndarray  # int32 [T]: each token's row in its lane
    positions: np.ndarray  # int32 [T]: its position (a tree's siblings share one)
    masks: np.ndarray | None  # uint64 [T]: tree masks; None without trees
    logits_rows: np.ndarray  # int32 [N]


def native_inputs(batch: StepBatch, lanes: list[int]) -> NativeInputs:
    """The native step's inputs for `batch`, its sequences in `lanes`.

    Per-token lists in Python, one array each: numpy calls per sequence cost more than the
    work at decode.
    """
    tokens = np.asarray([t for seq in batch.token_ids for t in seq], np.int64)
    token_lanes = np.asarray([lane for lane, seq in zip(lanes, batch.token_ids, strict=True)
                              for _ in seq], np.int32)
    lane_rows = np.asarray([row for start, seq in
                            zip(batch.context_lens, batch.token_ids, strict=True)
                            for row in range(start, start + len(seq))], np.int32)
    positions, masks = lane_rows, None
    if batch.query_parents is not None:  # a tree's siblings share a position
        positions, masks = batch.positions(), batch.tree_masks()
    return NativeInputs(tokens, token_lanes, lane_rows, positions, masks,
                        batch.logits_indices.astype(np.int32))
