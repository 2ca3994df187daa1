"""SpeculationMetrics' rates and their sum over requests."""

from __future__ import annotations

from llmopt.runtime.speculative.metrics import SpeculationMetrics, total_speculation


def test_rates_come_from_the_counters():
    m = SpeculationMetrics(num_decode_steps=10, num_spec_steps=4, num_draft_tokens=12,
                           num_accepted_tokens=6)
    assert m.acceptance_rate == 0.5
    assert m.mean_accepted_length == 1.5
    assert m.tokens_per_step(16) == 1.6
    assert m.to_dict(16)["acceptance_rate"] == 0.5


def test_without_drafts_the_rates_are_none():
    m = SpeculationMetrics(3, 0, 0, 0)
    assert m.acceptance_rate is None and m.mean_accepted_length is None
    assert m.tokens_per_step(3) == 1.0


def test_the_total_sums_every_counter_and_skips_requests_without_metrics():
    a, b = SpeculationMetrics(10, 4, 12, 6), SpeculationMetrics(5, 1, 3, 3)
    assert total_speculation([a, None, b]) == SpeculationMetrics(15, 5, 15, 9)


def test_the_total_is_none_when_nothing_speculated():
    assert total_speculation([]) is None
    assert total_speculation([SpeculationMetrics(4, 0, 0, 0), None]) is None
