"""StepBatch: what one engine step hands a model executor, and the Executor protocol.

Sequences are packed: sequence b's query tokens are the rows
`query_start[b] .. query_start[b] + query_lens[b] - 1` of the step, and `slot_mapping`
and `logits_indices` index those packed rows. Each executor turns this into its own
layout (OrtExecutor: the right-padded [B, S] tensors of the paged-KV contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.scheduler import ScheduledRequest


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


def make_step_batch(
    scheduled: list[ScheduledRequest], kv_cache_manager: KVCacheManager
) -> StepBatch:
    """The StepBatch for a scheduler step; logits rows follow `scheduled`'s order."""
    token_ids, context_lens, block_tables, slots, logits_indices = [], [], [], [], []
    row = 0
    for item in scheduled:
        request, start, n = item.request, item.request.num_computed_tokens, item.num_tokens
        token_ids.append((request.all_token_ids + request.spec_token_ids)[start : start + n])
        context_lens.append(start)
        block_tables.append(kv_cache_manager.block_ids(request))
        slots.append(kv_cache_manager.slot_mapping(request, start, n))
        logits_indices.extend(row + offset for offset in logits_offsets(item))
        row += n
    return StepBatch(
        token_ids=token_ids,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=np.concatenate(slots).astype(np.int64),
        logits_indices=np.asarray(logits_indices, dtype=np.int64),
    )


def logits_offsets(item: ScheduledRequest) -> range:
    """Query offsets of a scheduled request whose logits the step needs.

    Its last query row when the step catches it up with its known tokens (that row gives
    the next token), and with draft tokens the rows of the last known token and of every
    draft (the target's distribution after each); every row that has a next token when
    it is scored.
    """
    request, start, n = item.request, item.request.num_computed_tokens, item.num_tokens
    if request.score_only:
        return range(min(n, request.num_tokens - 1 - start))
    num_drafts = len(request.spec_token_ids)
    if start + n == request.num_tokens + num_drafts:
        return range(n - 1 - num_drafts, n)
    return range(0)
