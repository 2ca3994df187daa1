"""The speculative cost model shared by the draft pass's γ choice and the runtime policy."""

from __future__ import annotations

import pytest

from llmopt.runtime.speculative.cost_model import (
    best_gamma,
    expected_tokens_per_position,
    model_step_cost,
)


def test_expected_tokens_and_gamma_choice():
    alphas = [0.8, 0.5, 0.5, 0.1]
    assert expected_tokens_per_position(alphas, 1) == pytest.approx(1.8)
    assert expected_tokens_per_position(alphas, 2) == pytest.approx(2.2)
    assert expected_tokens_per_position(alphas, 3) == pytest.approx(2.4)
    # draft 0.1 of a target step; verifying γ+1 tokens costs 1 + 0.05 γ target steps
    costs = [model_step_cost(g, 0.1, 1 + 0.05 * g) for g in range(1, 5)]
    tokens = [expected_tokens_per_position(alphas, g) for g in range(1, 5)]
    gamma, speedup = best_gamma(tokens, costs)
    # 1.8/1.15 = 1.565, 2.2/1.3 = 1.692, 2.4/1.45 = 1.655, 2.42/1.6 = 1.51
    assert gamma == 2 and speedup == pytest.approx(2.2 / 1.3)
    # A free draft and a free verification: the longest γ wins whenever α > 0.
    assert best_gamma(tokens, [1.0] * 4)[0] == 4
