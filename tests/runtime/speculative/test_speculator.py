"""Speculator: drafts that pay for the step keep being drafted and verified."""

from __future__ import annotations

from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import ScheduledRequest
from llmopt.runtime.speculative.drafter import Proposal
from llmopt.runtime.speculative.policy import SpeculationPolicy
from llmopt.runtime.speculative.speculator import Speculator


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
    return max(item.num_spec_tokens for item in kept)


def batch(size: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(size)]


def test_drafts_that_pay_keep_drafting():
    drafter = CountingDrafter()
    speculator = Speculator(drafter, 2, policy=priced([1.0, 1.02, 1.04]))
    rows = batch(1)
    assert [step(speculator, rows) for _ in range(12)] == [2] * 12
    assert drafter.calls == 12
