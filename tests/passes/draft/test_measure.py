"""Measuring a draft: acceptance from run lengths, n-gram simulation, teacher-forced
agreement on the lowered graphs."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.compiler.recipe import Recipe
from llmopt.passes.draft.measure import (
    Trajectory,
    position_acceptance,
    run_lengths,
    simulate,
)
from llmopt.runtime.speculative.drafter import NgramDrafter

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_acceptance_per_position_from_run_lengths():
    agree = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=bool)
    runs = run_lengths(agree, cap=2)
    assert runs.tolist() == [2, 1, 0, 1, 0, 0, 2, 2, 1]
    alphas = position_acceptance(runs, 2)
    assert alphas == pytest.approx([6 / 9, 3 / 6])


def test_ngram_simulation_on_a_repeating_trajectory():
    tokens = [5, 6, 7, 8] * 6
    steps = simulate([Trajectory(tokens, prompt_len=8)], gamma=4, ngram=NgramDrafter(1, 3).lookup)
    assert set(steps.sources) == {"ngram"} and steps.accepted == [4] * 3 + [0]
    assert steps.tokens_per_step() == pytest.approx(16 / 4)
    # With no match and a model draft, the model's teacher-forced agreement decides.
    agree = np.zeros(10, dtype=bool)
    agree[3:6] = True
    steps = simulate([Trajectory(list(range(10)), 3, agree)], gamma=2,
                     ngram=NgramDrafter(1, 2).lookup)
    assert steps.sources == ["model"] * 5 and steps.accepted == [2, 0, 0, 0, 0]  # 5: a bonus


def test_the_target_as_its_own_draft_is_always_accepted(target, tmp_path):
    """Teacher-forced agreement along the target's own greedy trajectory is exact."""
    from llmopt.compiler.draft_pairing import lowered_executor
    from llmopt.passes.draft import measure as m

    recipe = Recipe(model="unused", runtime={"block_size": 4, "max_context": 128})
    runner = m.PagedRunner(lowered_executor(target, recipe, tmp_path / "t.onnx", 65, 16), 4, 16)
    (traj,) = m.greedy_trajectories(runner, [[5, 9, 13, 40, 41]], 24, eos_ids=())
    assert len(traj.tokens) == 5 + 24
    agree = m.draft_agreement(runner, traj, None)
    assert agree[5:].all() and not agree[:5].any()
