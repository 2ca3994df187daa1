"""StructuredOutputManager: what the engine asks of structured outputs in a step.

Each constrained request holds an llguidance matcher at the state after its output so far.
Per step: the rows to sample get their masks in one batch (`mask_rows`); the tokens
emitted then advance the matcher (`accept`). Near the end of a request's `max_tokens` its
rows allow only the next token of the grammar's closing path (`closing.py`), so the answer
finishes valid. `fill_row` masks one row at any matcher state, for callers that verify
several positions of a request in one step.
"""

from __future__ import annotations

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
            forced = self.closer.forced_token(requests[i].grammar, remaining_tokens(requests[i]))
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

    def fill_row(self, matcher: Any, bitmask: np.ndarray, row: int, budget: int) -> None:
        """Row `row` of `bitmask`: the matcher's mask, or only the closing path's next token."""
        forced = self.closer.forced_token(matcher, budget)
        if forced is None:
            fill_mask(matcher, bitmask, row)
        else:
            allow_only(bitmask, row, forced)

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


def remaining_tokens(request: Request) -> int:
    """Tokens the request may still generate."""
    return request.sampling_params.max_tokens - len(request.output_token_ids)
