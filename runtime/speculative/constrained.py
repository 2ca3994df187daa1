"""Drafts under a grammar: structured outputs meet speculation.

A deterministic drafter's chain is cut before the first token the grammar rejects
(`trim_drafts`); a request verifying drafts gets each row masked at the grammar state
after the drafts before it (`mask_draft_rows`), so the exact rule sees the constrained
distribution p and an invalid draft has p = 0.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from llmopt.runtime.structured.manager import remaining_tokens
from llmopt.runtime.structured.masks import allow_all, apply_masks

if TYPE_CHECKING:
    from llmopt.runtime.scheduler import ScheduledRequest
    from llmopt.runtime.speculative.drafter import Proposal
    from llmopt.runtime.structured.manager import StructuredOutputManager


def mask_draft_rows(structured: StructuredOutputManager, item: ScheduledRequest,
                    logits: np.ndarray) -> np.ndarray:
    """A drafting request's rows, each masked at the grammar state its row predicts
    from: row 0 after the output so far, row i + 1 after draft node i's path (a chain's
    path is drafts 0..i). Rows behind an invalid draft are never read; left unmasked."""
    request, drafts = item.request, item.spec_token_ids
    matcher = request.grammar
    parents = item.spec_parents if item.spec_parents is not None else range(-1, len(drafts) - 1)
    bitmask = allow_all(len(drafts) + 1, structured.vocab_size)
    budget = remaining_tokens(request)
    structured.fill_row(matcher, bitmask, 0, budget)
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        path = [*(paths[parent] if parent >= 0 else []), drafts[node]]
        paths.append(path)
        if matcher.validate_tokens(path) == len(path):
            matcher.consume_tokens(path)
            structured.fill_row(matcher, bitmask, node + 1, budget - len(path))
            matcher.rollback(len(path))
    return apply_masks(logits, bitmask)


def trim_drafts(scheduled: list[ScheduledRequest],
                drafts: dict[str, Proposal]) -> list[ScheduledRequest]:
    """Cut a constrained request's chain of drafts (`drafts`, by request id, cut too)
    before its first one the grammar rejects, where that changes no output's
    distribution: deterministic drafts (kept with probability p(x) = 0 otherwise, the
    replacement drawn from p) or greedy."""
    out = list(scheduled)
    for i, item in enumerate(scheduled):
        request = item.request
        proposal = drafts.get(request.request_id)
        if (request.grammar is None or proposal is None or proposal.parents is not None
                or not (proposal.probs is None or request.sampling_params.greedy)):
            continue
        valid = request.grammar.validate_tokens(list(proposal.token_ids))
        if valid == len(proposal.token_ids):
            continue
        kept = proposal.first(valid)
        if kept.token_ids:
            drafts[request.request_id] = kept
        else:
            del drafts[request.request_id]
        out[i] = dataclasses.replace(
            item, num_tokens=item.num_tokens - (len(proposal.token_ids) - valid),
            num_spec_tokens=valid, spec_token_ids=tuple(kept.token_ids))
    return out
