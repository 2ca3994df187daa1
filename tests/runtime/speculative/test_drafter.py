from __future__ import annotations

import pytest

from llmopt.runtime.speculative.drafter import NgramDrafter, ngram_lookup


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # "2 3" occurs at 1 and 5; the latest earlier one (5) was followed by 4 5 7.
    assert ngram_lookup(tokens, 1, 4, 3) == [4, 5, 7]
    # A longer suffix wins over a more recent shorter one: "7 2 3" never occurred
    # before, "2 3" did.
    assert ngram_lookup([5, 2, 3, 8, 8, 3, 2, 3], 1, 3, 2) == [8, 8]


def test_ngram_lookup_stops_at_the_end_and_misses_cleanly():
    assert ngram_lookup([4, 5, 6, 4, 5], 1, 3, 8) == [6, 4, 5]
    assert ngram_lookup([1, 2, 3], 1, 3, 4) == []
    assert ngram_lookup([7], 1, 3, 4) == []
    assert ngram_lookup([4, 4, 4, 4], 2, 2, 3) == [4]  # the match right before the suffix


def test_ngram_drafter_checks_its_bounds():
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(3, 2)


class NoModel:
    """A second drafter that records what it was asked for."""

    def __init__(self):
        self.asked: list[int] = []

    def propose(self, requests, max_tokens, budget=None):
        from llmopt.runtime.speculative.drafter import Proposal

        limits = [min(k, budget(r, "model")) if budget else k
                  for r, k in zip(requests, max_tokens, strict=True)]
        self.asked += limits
        return [Proposal([7] * k, source="model") for k in limits]


def test_the_budget_caps_each_source_before_it_drafts():
    from llmopt.runtime.request import Request
    from llmopt.runtime.sampling_params import SamplingParams
    from llmopt.runtime.speculative.drafter import FallbackDrafter

    repeating = Request("a", [1, 2, 3, 4, 9, 1, 2, 3], SamplingParams())  # "1 2 3" matches
    limits = {"ngram3": 2, "ngram1": 0, "model": 1}
    budget = lambda request, source: limits.get(source, 5)  # noqa: E731
    ngram = NgramDrafter(1, 3)
    assert ngram.propose([repeating], [4], budget)[0].token_ids == [4, 9]
    assert ngram.propose([repeating], [4])[0].token_ids == [4, 9, 1, 2]

    # A 1-token match priced out falls back to the model, which drafts only its budget.
    single = Request("b", [5, 6, 5], SamplingParams())  # "5" matches, a 1-gram
    model = NoModel()
    proposals = FallbackDrafter(ngram, model).propose([repeating, single], [4, 4], budget)
    assert [p.source for p in proposals] == ["ngram3", "model"]
    assert proposals[1].token_ids == [7] and model.asked == [1]
