"""Log-probabilities of emitted tokens, for clients that ask for them (OpenAI `logprobs`).

They are the model's own distribution (log-softmax of the raw logits, before repetition
penalty, temperature or truncation), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmopt.runtime.sampler import log_softmax


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens, most likely first


def token_logprobs(logits: np.ndarray, token_ids: Sequence[int], num_top: int) -> list[
        TokenLogprob]:
    """Row r of `logits` [N, vocab] gave `token_ids[r]`; its logprob and `num_top` best."""
    rows = log_softmax(np.asarray(logits[: len(token_ids)]))
    result = []
    for row, token_id in zip(rows, token_ids, strict=True):
        top: tuple[tuple[int, float], ...] = ()
        if num_top > 0:
            best = np.argpartition(-row, num_top - 1)[:num_top]
            best = best[np.argsort(-row[best], kind="stable")]
            top = tuple((int(t), float(row[t])) for t in best)
        result.append(TokenLogprob(int(token_id), float(row[token_id]), top))
    return result
