from __future__ import annotations

import pytest

from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.speculative.governor import SpeculationGovernor
from llmopt.runtime.speculative.policy import SpeculationPolicy

VERIFY_COST = [1.0, 1.2, 1.3, 1.4, 1.5]  # what the manifest predicts


def step_time(num_drafts: list[int], plain_s: float, dearer: float) -> float:
    """A fake machine whose verification costs `dearer` times the manifest's extra."""
    extra = sum(VERIFY_COST[k] - 1 for k in num_drafts) / len(num_drafts)
    return plain_s * (1 + dearer * extra)


def drive(governor: SpeculationGovernor, policy: SpeculationPolicy, batch: int, steps: int,
          plain_s: float, dearer: float) -> list[int]:
    """Run `steps` decode steps of `batch` sequences whose drafts the policy sizes (every
    sequence at the prior α); returns the drafts per sequence of each step."""
    request = Request("r", [1, 2, 3], SamplingParams())
    history = []
    for _ in range(steps):
        prices = governor.prices(batch)
        policy.set_prices(prices.cost_scale, prices.draft_cost)
        k = policy.num_drafts(request) if governor.allows(batch) else 0
        drafts = [k] * batch
        governor.record(drafts, step_time(drafts, plain_s, dearer))
        history.append(k)
    return history


def make(prior_alpha: float = 0.6) -> tuple[SpeculationGovernor, SpeculationPolicy]:
    return (SpeculationGovernor(VERIFY_COST, 0.0, probe_every=16),
            SpeculationPolicy(4, VERIFY_COST, 0.0, prior_alpha=prior_alpha))


def test_the_first_step_of_a_bucket_is_plain_and_plain_probes_recur():
    governor, policy = make()
    history = drive(governor, policy, 1, 64, plain_s=0.010, dearer=1.0)
    assert history[0] == 0  # nothing to compare against yet
    assert [i for i, k in enumerate(history) if k == 0] == [0, 16, 32, 48]


def test_verification_as_cheap_as_predicted_keeps_the_manifest_prices():
    governor, policy = make()
    drive(governor, policy, 1, 100, plain_s=0.010, dearer=1.0)
    assert governor.prices(1).cost_scale == pytest.approx(1.0, abs=0.15)


def test_verification_dearer_than_predicted_prices_drafts_out():
    governor, policy = make()
    history = drive(governor, policy, 1, 200, plain_s=0.010, dearer=8.0)
    assert history[1] > 0  # the manifest's prices said drafts pay
    assert governor.prices(1).cost_scale > 3
    assert sum(k > 0 for k in history[100:]) <= 5  # so the policy stopped drafting


def test_a_priced_out_bucket_drifts_back_and_is_retried():
    governor, policy = make()
    drive(governor, policy, 1, 100, plain_s=0.010, dearer=8.0)
    high = governor.prices(1).cost_scale
    for _ in range(300):
        governor.record([0], 0.010)  # plain steps feed no cost evidence: it fades
    assert governor.prices(1).cost_scale < 1 + (high - 1) * 0.1


def test_batch_size_buckets_are_priced_separately():
    governor, policy = make()
    drive(governor, policy, 16, 100, plain_s=0.020, dearer=8.0)  # dear at batch 16
    drive(governor, policy, 1, 100, plain_s=0.010, dearer=1.0)
    assert governor.prices(16).cost_scale > 3
    assert governor.prices(1).cost_scale == pytest.approx(1.0, abs=0.15)


def test_the_draft_step_cost_is_measured_against_the_plain_step():
    governor = SpeculationGovernor(VERIFY_COST, draft_cost=0.05)
    governor.record([0], 0.010)
    for _ in range(200):
        governor.record([2], 0.013, draft_seconds=0.004)  # two draft steps of 2 ms
    assert governor.prices(1).draft_cost == pytest.approx(0.2, rel=0.05)


def test_a_burst_of_load_on_a_few_steps_does_not_set_the_price():
    governor = SpeculationGovernor(VERIFY_COST, 0.0)
    governor.record([0], 0.010)
    for i in range(100):  # costs what the manifest says, but every 10th step is 10x slow
        governor.record([4], 0.015 * (10 if i % 10 == 0 else 1))
    assert governor.prices(1).cost_scale < 1.5
    stale = SpeculationGovernor(VERIFY_COST, 0.0)
    stale.record([0], 0.030)  # the plain reference was timed under load that then ended
    for _ in range(20):
        stale.record([4], 0.015)
    assert stale.prices(1).cost_scale > 0.15  # unclipped: 0.03
