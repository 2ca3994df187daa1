"""Speculator: a batch size whose drafts the step's price keeps discarding stops drafting
for a while, then tries again."""

from __future__ import annotations

import pytest

from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import ScheduledRequest
from llmopt.runtime.speculative.drafter import Proposal
from llmopt.runtime.speculative.policy import SpeculationPolicy
from llmopt.runtime.speculative.speculator import DISCARDED_STEPS, RESTING_STEPS, Speculator


class CountingDrafter:
    """Drafts two tokens for every sequence, and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, requests, budgets, budget=None) -> list[Proposal]:
        self.calls += 1
        return [Proposal([7, 8], source="ngram2") for _ in requests]


def priced(verify_cost: list[float]) -> SpeculationPolicy:
    """A policy of γ = 2 with good drafts: the step's price decides alone."""
    return SpeculationPolicy(2, verify_cost, 0.0, prior_alpha=0.9)


def step(speculator: Speculator, batch: list[Request]) -> int | None:
    """One step's drafting: the drafts each sequence keeps (None: none were asked for)."""
    budget = speculator.max_drafts(len(batch))
    if budget is None:
        return None
    scheduled = [ScheduledRequest(r, 1 + budget(r), budget(r)) for r in batch]
    kept = speculator.propose(scheduled)
    for item in kept:
        item.request.speculation.token_ids = []
    return max(item.num_spec_tokens for item in kept)


def batch(size: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(size)]


def alone_only(drafted, others=()) -> int:
    """A step's price where a sequence's drafts pay alone and never beside others."""
    return 2 if len(drafted) == 1 and not others else 0


def test_a_batch_size_whose_drafts_are_always_discarded_rests_then_retries():
    drafter = CountingDrafter()
    policy = priced([1.0, 1.02, 1.04])
    policy.cap = alone_only
    speculator = Speculator(drafter, 2, policy=policy)
    rows = batch(8)
    assert [step(speculator, rows) for _ in range(DISCARDED_STEPS)] == [0] * DISCARDED_STEPS
    assert drafter.calls == DISCARDED_STEPS
    assert [step(speculator, rows) for _ in range(RESTING_STEPS)] == [None] * RESTING_STEPS
    assert drafter.calls == DISCARDED_STEPS  # no drafting while resting
    assert step(speculator, rows) == 0  # tries again
    assert drafter.calls == DISCARDED_STEPS + 1
    assert step(speculator, batch(1)) == 2  # other batch sizes keep their own record


def test_drafts_nobody_would_keep_do_not_rest_the_batch_size():
    """At batch 1, or when no sequence would keep its drafts even alone, a discarded step
    says nothing about the batch: the next step drafts again."""
    for size in (1, 8):
        drafter = CountingDrafter()
        policy = priced([1.0, 1.02, 1.04])
        policy.cap = lambda drafted, others=(): 0
        speculator = Speculator(drafter, 2, policy=policy)
        rows = batch(size)
        steps = 3 * DISCARDED_STEPS
        assert [step(speculator, rows) for _ in range(steps)] == [0] * steps
        assert drafter.calls == steps


def test_drafts_that_pay_keep_drafting():
    drafter = CountingDrafter()
    speculator = Speculator(drafter, 2, policy=priced([1.0, 1.02, 1.04]))
    rows = batch(1)
    assert [step(speculator, rows) for _ in range(3 * DISCARDED_STEPS)] == [2] * (
        3 * DISCARDED_STEPS)
    assert drafter.calls == 3 * DISCARDED_STEPS


def test_a_step_settles_what_its_drafts_promised_against_what_verification_kept():
    speculator = Speculator(CountingDrafter(), 2, policy=priced([1.0, 1.02, 1.04]))
    rows = batch(4)
    budget = speculator.max_drafts(len(rows))
    scheduled = speculator.propose([ScheduledRequest(r, 1 + budget(r), budget(r))
                                    for r in rows])
    promised = speculator.policy.promised(
        [(item.request, "ngram2", 2) for item in scheduled], 2)
    for i, item in enumerate(scheduled):  # the first sequence keeps one draft, others none
        speculator.observe(item.request, [7, 5] if i == 0 else [5])
    speculator.record_step(scheduled, 0.01)
    kept, recorded = speculator.policy.promises[3]  # batch 4's bucket
    assert (kept, recorded) == (1, pytest.approx(promised))
    assert speculator.promise is None
