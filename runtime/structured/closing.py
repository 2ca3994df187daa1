"""Closing a constrained answer within its token budget.

A small model can loop inside an unbounded array or string until `max_tokens` cuts the
answer off, unparseable. So once the tokens left barely cover the shortest way the grammar
allows to finish, the answer is steered onto that way: each step allows only the next token
of a closing path, ending with the end of sequence. The path is found greedily on a copy of
the matcher: forced tokens, else the end of sequence, else (among a few allowed tokens) one
that completes the grammar, else for JSON (inside a string, told by plain letters being
allowed) the closing quote, else the first allowed of `}`, `]`, `,`, `0`, `false`, `null`,
`[`, `{`, `"`, else the lowest allowed token that is not whitespace. The answer finishes
complete and valid, shortened; until then nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from llmopt.runtime.tokenizer import Tokenizer

CLOSERS = ["}", "]", ",", "0", "false", "null", "[", "{"]
LETTERS = "qxzkjQXZKJ"  # never allowed outside a JSON string (unlike t, f, n, e, E)
WINDOW = 96  # look for the closing path only this close to the budget's end
MARGIN = 8  # a token can open several levels at once: start closing this much early
LOOKAHEAD = 256  # try each allowed token for one that completes the grammar, up to this many


class Closer:
    """Closing paths for one tokenizer's grammars."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]):
        def single(texts: Sequence[str]) -> list[int]:
            encoded = [tokenizer.encode(t, add_bos=False, add_eos=False) for t in texts]
            return [ids[0] for ids in encoded if len(ids) == 1]

        self.eos = list(eos_token_ids)
        self.closers = single(CLOSERS)
        self.quote = single(['"'])
        self.letters = single(list(LETTERS))
        texts = tokenizer.tokenizer.decode_batch([[i] for i in range(tokenizer.vocab_size)])
        self.whitespace = {i for i, text in enumerate(texts) if not text.strip()}

    def forced_token(self, matcher: Any, budget: int) -> int | None:
        """The token to force when `budget` tokens are left for the answer (None: the model
        chooses)."""
        if budget > WINDOW or matcher.is_stopped():
            return None
        path = self.closing_path(matcher, budget)
        return path[0] if path and len(path) + MARGIN >= budget else None

    def closing_path(self, matcher: Any, limit: int) -> list[int]:
        """The tokens that finish the answer soon from `matcher`'s state (at most `limit`
        + 1 of them: longer ones are cut), ending with the end of sequence."""
        sim, path = matcher.deep_copy(), []
        while len(path) <= limit and not sim.is_stopped():
            tokens = sim.compute_ff_tokens() or [self._next(sim)]
            if not sim.consume_tokens(tokens):
                break
            path += tokens
        return path

    def _next(self, matcher: Any) -> int:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")
        tokens = np.flatnonzero(bits).tolist()
        allowed = set(tokens)
        eos = next((t for t in self.eos if t in allowed), None)
        if eos is not None:
            return eos
        if len(tokens) <= LOOKAHEAD:
            done = next((t for t in tokens if _completes(matcher, t)), None)
            if done is not None:
                return done
        in_string = any(t in allowed for t in self.letters)
        order = [*(self.quote if in_string else ()), *self.closers, *self.quote]
        first = next((t for t in order if t in allowed), None)
        if first is not None:
            return first
        return next((t for t in tokens if t not in self.whitespace), tokens[0])


def _completes(matcher: Any, token: int) -> bool:
    """Whether `token` leaves the grammar complete (tried, then taken back)."""
    if not matcher.consume_token(token):
        return False
    done = matcher.is_accepting()
    matcher.rollback(1)
    return done
