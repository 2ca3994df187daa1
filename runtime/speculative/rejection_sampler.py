"""Verify a sequence's draft tokens against the target's logits: the exact rule.

Leviathan et al. (2023) / Chen et al. (2023): draft token x, drawn from the draft's
distribution q, is accepted with probability min(1, p(x) / q(x)), where p is the
target's distribution at that position. At the first rejection the replacement is
drawn from norm(max(0, p - q)); when every draft token is accepted, a bonus token is
drawn from the target's next distribution. Each emitted token is then distributed
exactly as p, whatever q is. A deterministic draft (n-gram lookup) has q one-hot on x,
so x is kept with probability p(x) and the replacement comes from p with x removed.

Greedy rows compare argmaxes: a draft token is kept when it is the target's argmax.

p and q are the distributions actually sampled from, after repetition penalty,
temperature, top-k, top-p and min-p (`sampler.token_probs`), and position i's penalty
counts the draft tokens before it, as plain decoding would have.

A draft tree (`verify_tree`) offers several deterministic candidates per position. They
are tried in turn, each against what is left of p once the earlier ones were rejected
(SpecInfer's multi-candidate rule for one-hot drafts): candidate c is kept with
probability p'(c), where p' is p with the rejected candidates removed and renormalized;
when all fail, the token is drawn from what is left. Token by token this draws from p,
so a tree's output is distributed exactly as plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmopt.runtime.sampler import draw, sample, token_probs
from llmopt.runtime.sampling_params import SamplingParams


def verify_drafts(
    target_logits: np.ndarray,
    draft_token_ids: Sequence[int],
    draft_probs: np.ndarray | None,
    params: SamplingParams,
    generator: np.random.Generator,
    seen_token_ids: Sequence[int],
) -> list[int]:
    """The tokens one sequence emits this step: its accepted drafts plus one more.

    target_logits: [γ + 1, vocab], row i predicts the token after draft i - 1 (row 0:
        the token after the last known one). draft_probs: [γ, vocab] distributions the
        drafts were drawn from, or None for a deterministic draft. seen_token_ids: the
        sequence's prompt and output tokens before the drafts.
    """
    seen = list(seen_token_ids)
    emitted: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        token = _judge(target_logits[i], draft, _row(draft_probs, i), params, generator, seen)
        emitted.append(token)
        if token != draft:
            return emitted
        seen.append(token)
    emitted.append(_next_token(target_logits[len(draft_token_ids)], params, generator, seen))
    return emitted


def _judge(
    logits: np.ndarray,
    draft: int,
    draft_probs: np.ndarray | None,
    params: SamplingParams,
    generator: np.random.Generator,
    seen: list[int],
) -> int:
    """`draft` if accepted, otherwise the replacement token."""
    if params.greedy:
        return _next_token(logits, params, generator, seen)
    p = token_probs(logits, params, seen)
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft])
    if generator.random() * q_draft < p[draft]:  # u < p(x) / q(x), without dividing by 0
        return draft
    residual = p.copy()
    if draft_probs is None:
        residual[draft] = 0.0
    else:
        residual = np.maximum(residual - draft_probs, 0.0)
    if residual.sum() <= 0.0:  # p == q up to round-off: the rejection itself was round-off
        residual = p
    return draw(residual, generator)


def _next_token(
    logits: np.ndarray, params: SamplingParams, generator: np.random.Generator, seen: list[int]
) -> int:
    return int(sample(logits[None, :], [params], [generator], [seen])[0])


def _row(probs: np.ndarray | None, i: int) -> np.ndarray | None:
    return None if probs is None else probs[i]


def verify_tree(
    target_logits: np.ndarray,
    draft_token_ids: Sequence[int],
    parents: Sequence[int],
    params: SamplingParams,
    generator: np.random.Generator,
    seen_token_ids: Sequence[int],
) -> tuple[list[int], list[int]]:
    """The tokens one sequence emits from a tree of deterministic drafts, and the nodes
    accepted on the way (root to leaf).

    target_logits: [nodes + 1, vocab], row 0 the distribution after the last known
        token, row i + 1 the one after node i. parents[i]: node i's parent (-1: the last
        known token); nodes come after their parents, siblings best first and distinct.
    """
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    seen = list(seen_token_ids)
    emitted: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        logits = target_logits[node + 1]
        candidates = children.get(node, [])
        token = (_next_token(logits, params, generator, seen) if params.greedy
                 else _judge_candidates(logits, [draft_token_ids[c] for c in candidates],
                                        params, generator, seen))
        emitted.append(token)
        kept = next((c for c in candidates if draft_token_ids[c] == token), None)
        if kept is None:
            return emitted, path
        path.append(kept)
        seen.append(token)
        node = kept


def _judge_candidates(logits: np.ndarray, candidates: Sequence[int], params: SamplingParams,
                      generator: np.random.Generator, seen: list[int]) -> int:
    """One position of a tree: the first candidate kept, or the replacement drawn from
    what the rejected ones left."""
    p = token_probs(logits, params, seen)
    for candidate in candidates:
        total = p.sum()
        if total <= 0.0:
            break
        if generator.random() * total < p[candidate]:  # u < p'(c), p' = p / total
            return candidate
        p = p.copy()
        p[candidate] = 0.0
    if p.sum() <= 0.0:  # every token the target allows was a rejected candidate: round-off
        p = token_probs(logits, params, seen)
    return draw(p, generator)
