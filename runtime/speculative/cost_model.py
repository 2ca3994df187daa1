"""What a speculative step emits and costs: the one model the compiler's γ choice and the
runtime's per-sequence policy share.

A step with k drafts emits the drafts accepted in a row plus one more token (the
target's correction or bonus). With per-position acceptance α_j (draft j accepted given
drafts 1..j-1 were) that is 1 + Σ_{i≤k} Π_{j≤i} α_j tokens in expectation; with one
i.i.d. α it is (1 - α^(k+1)) / (1 - α). It costs a (k+1)-token target step plus k
draft steps, in units of a plain 1-token target step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Tokens a step emits with `num_drafts` drafts, each accepted with probability α."""
    if alpha >= 1.0:
        return num_drafts + 1.0
    return (1.0 - alpha ** (num_drafts + 1)) / (1.0 - alpha)


def expected_tokens_per_position(alphas: Sequence[float], num_drafts: int) -> float:
    """Tokens a step emits with `num_drafts` drafts and per-position rates `alphas`."""
    total, survive = 1.0, 1.0
    for alpha in alphas[:num_drafts]:
        survive *= alpha
        total += survive
    return total


def equivalent_alpha(acceptance: Sequence[float], gamma: int) -> float:
    """The i.i.d. α that emits as many tokens per γ-draft step as the per-position rates
    (the runtime's policy models acceptance as i.i.d.)."""
    rates = (list(acceptance) + [acceptance[-1]] * gamma)[:gamma]
    target = 1.0 + float(np.sum(np.cumprod(rates)))
    low, high = 0.0, 1.0
    for _ in range(40):  # expected_tokens grows with α: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, gamma) < target else (low, middle)
    return (low + high) / 2


def model_step_cost(num_drafts: int, draft_cost: float, verify_cost: float) -> float:
    """A step with `num_drafts` drafts in plain target steps: that many draft steps plus
    a (k+1)-token verification costing `verify_cost` plain steps."""
    return num_drafts * draft_cost + verify_cost


def step_cost(num_drafts: int, verify_cost: Sequence[float], draft_cost: float) -> float:
    """The same from the compiler's table `verify_cost[k]` ((k+1)-token step over a plain
    one)."""
    return model_step_cost(num_drafts, draft_cost, verify_cost[num_drafts])


def best_gamma(tokens_per_step: Sequence[float], cost_per_step: Sequence[float]
               ) -> tuple[int, float]:
    """(γ, speedup) maximising tokens/cost; entry γ-1 is γ's (costs in target steps)."""
    speedups = [t / c for t, c in zip(tokens_per_step, cost_per_step, strict=True)]
    best = max(range(len(speedups)), key=lambda i: speedups[i])
    return best + 1, speedups[best]
