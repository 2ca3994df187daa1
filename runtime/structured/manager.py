"""StructuredOutputManager: what the engine asks of structured outputs in a step.

Each constrained request holds an llguidance matcher at the state after its output so far.
Per step: drafts a deterministic drafter proposed are cut where the grammar rejects them
(`trim_drafts`); the rows to sample get their masks in one batch (`mask_rows`); a request
verifying drafts gets each row masked at the state after the drafts before it
(`mask_draft_rows`), so the exact rule sees the constrained distribution p and an
invalid draft has p = 0; the tokens emitted then advance the matcher (`accept`). Near the
end of a request's `max_tokens` its rows allow only the next token of the grammar's
closing path (`closing.py`), so the answer finishes valid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llmopt.runtime.structured.closing import Closer
from llmopt.runtime.structured.compiler import GrammarCompiler
from llmopt.runtime.structured.masks import (
    allow_all,
    allow_only,
    apply_masks,
    fill_mask,
    fill_masks,
)
from llmopt.runtime.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from llmopt.runtime.request import Request
    from llmopt.runtime.scheduler import ScheduledRequest
    from llmopt.runtime.speculative.drafter import Proposal
    from llmopt.runtime.tokenizer import Tokenizer


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]):
        self.compiler = GrammarCompiler(tokenizer, eos_token_ids)
        self.vocab_size = self.compiler.vocab_size
        self.closer = Closer(tokenizer, eos_token_ids or [tokenizer.eos_token_id])
        self._executor: Any = None  # llguidance's thread pool, made on the first batch

    def matcher(self, params: StructuredOutputsParams) -> Any:
        return self.compiler.matcher(params)

    def mask_rows(self, requests: Sequence[Request], logits: np.ndarray) -> np.ndarray:
        """`logits` [len(requests), vocab] with the constrained requests' rows masked."""
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not constrained:
            return logits
        bitmask = allow_all(len(requests), self.vocab_size)
        free = []  # rows the grammar masks; the others are closing their answer
        for i in constrained:
            forced = self.closer.forced_token(requests[i].grammar, _budget(requests[i]))
            if forced is None:
                free.append(i)
            else:
                allow_only(bitmask, i, forced)
        if free:
            if self._executor is None and len(free) > 1:
                self._executor = self.compiler.llguidance.LLExecutor(num_threads=2)
            part = allow_all(len(free), self.vocab_size)
            fill_masks(self._executor, [requests[i].grammar for i in free], part)
            bitmask[free] = part
        return apply_masks(logits, bitmask)

    def mask_draft_rows(self, item: ScheduledRequest, logits: np.ndarray) -> np.ndarray:
        """A drafting request's rows, each masked at the grammar state its row predicts
        from: row 0 after the output so far, row i + 1 after draft node i's path (a chain's
        path is drafts 0..i). Rows behind an invalid draft are never read; left unmasked."""
        request, drafts = item.request, item.spec_token_ids
        matcher = request.grammar
        parents = item.spec_parents if item.spec_parents is not None else range(-1, len(drafts) - 1)
        bitmask = allow_all(len(drafts) + 1, self.vocab_size)
        budget = _budget(request)
        self._fill(matcher, bitmask, 0, budget)
        paths: list[list[int]] = []
        for node, parent in enumerate(parents):
            path = [*(paths[parent] if parent >= 0 else []), drafts[node]]
            paths.append(path)
            if matcher.validate_tokens(path) == len(path):
                matcher.consume_tokens(path)
                self._fill(matcher, bitmask, node + 1, budget - len(path))
                matcher.rollback(len(path))
        return apply_masks(logits, bitmask)

    def _fill(self, matcher: Any, bitmask: np.ndarray, row: int, budget: int) -> None:
        forced = self.closer.forced_token(matcher, budget)
        if forced is None:
            fill_mask(matcher, bitmask, row)
        else:
            allow_only(bitmask, row, forced)

    def trim_drafts(self, scheduled: list[ScheduledRequest],
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

    @staticmethod
    def accept(request: Request, tokens: Sequence[int]) -> None:
        """Advance the request's matcher over the tokens it emitted (up to its end)."""
        matcher = request.grammar
        for token in tokens:
            if matcher.is_stopped():
                return
            if not matcher.consume_token(token):
                raise RuntimeError(f"the grammar rejected emitted token {token}: "
                                   f"{matcher.get_error()}")


def _budget(request: Request) -> int:
    """Tokens the request may still generate."""
    return request.sampling_params.max_tokens - len(request.output_token_ids)
