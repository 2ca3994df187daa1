"""Sampler: next tokens from a [N, vocab] logits batch, each row with its own parameters.

The order follows Hugging Face `generate`: repetition penalty, then temperature, top-k,
top-p and min-p, then a draw from the remaining distribution. Greedy rows
(temperature 0) take the argmax, ties going to the lowest index like torch.argmax.

Every row draws with its own request's generator and uses exactly one uniform number
per token, so a seeded request gives the same tokens whatever batch it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmopt.runtime.sampling_params import SamplingParams


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    generators: Sequence[np.random.Generator],
    seen_token_ids: Sequence[Sequence[int]],
) -> np.ndarray:
    """One token id per row of `logits`; `seen_token_ids[r]` is row r's prompt + output."""
    penalties = [p.repetition_penalty for p in params]
    if any(penalty != 1.0 for penalty in penalties):
        logits = np.array(logits, dtype=np.float32)  # a copy: the penalties edit it in place
        apply_repetition_penalty(logits, penalties, seen_token_ids)
    token_ids = logits.argmax(axis=-1)  # right for greedy rows; random rows overwrite it
    for row, p in enumerate(params):
        if not p.greedy:
            candidates, probs = candidate_probs(logits[row], p)
            token_ids[row] = candidates[draw(probs, generators[row])]
    return token_ids.astype(np.int64)


def token_probs(
    logits: np.ndarray, params: SamplingParams, seen_token_ids: Sequence[int]
) -> np.ndarray:
    """float64 [vocab]: the distribution `sample` draws a non-greedy row from.

    Rejection sampling needs it whole: the acceptance ratio p(x)/q(x) and the residual
    max(0, p - q) are exact only against the distribution actually sampled from.
    """
    row = np.array(logits, dtype=np.float32)[None, :]
    apply_repetition_penalty(row, [params.repetition_penalty], [seen_token_ids])
    candidates, probs = candidate_probs(row[0], params)
    full = np.zeros(row.shape[1], dtype=np.float64)
    full[candidates] = probs
    return full


def apply_repetition_penalty(
    logits: np.ndarray, penalties: Sequence[float], seen_token_ids: Sequence[Sequence[int]]
) -> None:
    """HF semantics: a seen token's logit is divided by the penalty if positive, else multiplied."""
    for row, penalty in enumerate(penalties):
        if penalty == 1.0:
            continue
        seen = np.unique(np.asarray(seen_token_ids[row], dtype=np.int64))
        values = logits[row, seen]
        logits[row, seen] = np.where(values > 0, values / penalty, values * penalty)


def candidate_probs(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids that survive temperature, top-k, top-p and min-p, and their float64 probs.

    Top-k shrinks the row to its k candidates first: the masks after it see the others
    as -inf anyway, so working on the candidates alone gives the same result, faster.
    """
    scores = logits.astype(np.float64) / p.temperature
    candidates = np.arange(scores.size)
    if 0 < p.top_k < scores.size:
        candidates = top_k_candidates(scores, p.top_k)
        scores = scores[candidates]
    if p.top_p < 1.0:
        scores = top_p_mask(scores, p.top_p)
    if p.min_p > 0.0:
        scores = min_p_mask(scores, p.min_p)
    return candidates, softmax(scores)


def top_k_candidates(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of scores >= the k-th largest (ties at the threshold are kept, as in HF)."""
    threshold = np.partition(scores, scores.size - k)[scores.size - k]
    return np.flatnonzero(scores >= threshold)


def top_p_mask(scores: np.ndarray, top_p: float, num_first: int = 1024) -> np.ndarray:
    """Keep the most likely tokens until their mass reaches top_p (HF's rule).

    HF drops a token when the ascending cumulative probability up to it is <= 1 - top_p,
    i.e. when the mass of the tokens more likely than it is >= top_p. Sorting the whole
    vocabulary is slow, so the `num_first` most likely tokens are sorted first; only
    when they hold less than top_p does the full sort run.
    """
    probs = softmax(scores)
    order = _most_likely_first(probs, min(num_first, probs.size))
    mass_before = np.cumsum(probs[order]) - probs[order]
    if mass_before[-1] + probs[order[-1]] < top_p and order.size < probs.size:
        order = _most_likely_first(probs, probs.size)
        mass_before = np.cumsum(probs[order]) - probs[order]
    kept = order[mass_before < top_p]
    masked = np.full(scores.shape, -np.inf)
    masked[kept] = scores[kept]
    return masked


def _most_likely_first(probs: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` largest probs, in descending order."""
    top = np.argpartition(-probs, count - 1)[:count] if count < probs.size else np.arange(count)
    return top[np.argsort(-probs[top], kind="stable")]


def min_p_mask(scores: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens less likely than min_p times the most likely one."""
    probs = softmax(scores)
    return np.where(probs < min_p * probs.max(), -np.inf, scores)


def softmax(scores: np.ndarray) -> np.ndarray:
    exp = np.exp(scores - scores.max())
    return exp / exp.sum()


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """Inverse-CDF draw with one uniform number: the index where the CDF first exceeds it."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"))
    # Round-off can land past the last token with mass; step back onto one that has some.
    index = min(index, probs.size - 1)
    while probs[index] == 0.0:
        index -= 1
    return index


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32, for scoring."""
    logits = logits.astype(np.float32, copy=False)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
