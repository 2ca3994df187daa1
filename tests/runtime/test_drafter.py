from __future__ import annotations

import pytest

from llmopt.runtime.drafter import NgramDrafter, ngram_lookup


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
