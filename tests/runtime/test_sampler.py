import numpy as np
import pytest

from llmopt.runtime.sampler import (
    apply_repetition_penalty,
    candidate_probs,
    log_softmax,
    min_p_mask,
    sample,
    top_k_candidates,
    top_p_mask,
)
from llmopt.runtime.sampling_params import SamplingParams

PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def kept(scores: np.ndarray) -> list[int]:
    return np.flatnonzero(np.isfinite(scores)).tolist()


def test_greedy_is_argmax_with_ties_to_the_lowest_index():
    logits = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    params = [SamplingParams(temperature=0)] * 2
    gens = [np.random.default_rng(0)] * 2
    assert sample(logits, params, gens, [[], []]).tolist() == [1, 0]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_sampling_leaves_the_logits_it_is_given(penalty):
    """The engine samples a view of the step's logits and records logprobs from it after."""
    logits = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    before = logits.copy()
    params = [SamplingParams(temperature=0, repetition_penalty=penalty),
              SamplingParams(temperature=0.8, top_k=5, repetition_penalty=penalty),
              SamplingParams(temperature=1.0, top_p=0.9)]
    sample(logits, params, [np.random.default_rng(i) for i in range(3)], [[1, 2], [3], []])
    assert np.array_equal(logits, before)


def test_top_k_keeps_the_k_largest_and_ties_at_the_threshold():
    scores = np.array([1.0, 4.0, 3.0, 3.0, 0.0])
    assert top_k_candidates(scores, 2).tolist() == [1, 2, 3]
    assert top_k_candidates(scores, 1).tolist() == [1]
    assert top_k_candidates(scores, 4).tolist() == [0, 1, 2, 3]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    scores = np.log(PROBS)[[2, 0, 3, 1]]  # shuffled: probs 0.15, 0.5, 0.05, 0.3
    assert kept(top_p_mask(scores, 0.75)) == [1, 3]  # 0.5 + 0.3 >= 0.75
    assert kept(top_p_mask(scores, 0.9)) == [0, 1, 3]
    assert kept(top_p_mask(scores, 0.4)) == [1]
    assert kept(top_p_mask(scores, 1e-6)) == [1]  # the top token always stays


def test_top_p_partial_sort_agrees_with_the_full_sort():
    scores = np.random.default_rng(0).standard_normal(5000) * 2
    for top_p in (0.05, 0.5, 0.9, 0.999):
        # num_first=64 holds enough mass for small top_p and forces the fallback for large.
        expected = kept(top_p_mask(scores, top_p, num_first=5000))
        assert kept(top_p_mask(scores, top_p, num_first=64)) == expected


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    scores = np.log(PROBS)
    assert kept(min_p_mask(scores, 0.2)) == [0, 1, 2]  # threshold 0.1
    assert kept(min_p_mask(scores, 0.5)) == [0, 1]  # threshold 0.25


def test_repetition_penalty_follows_hf():
    logits = np.array([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]], np.float32)
    apply_repetition_penalty(logits, [2.0, 1.0], [[0, 1, 1], [0, 1]])
    np.testing.assert_array_equal(logits[0], [1.0, -4.0, 1.0, 0.5])
    np.testing.assert_array_equal(logits[1], [2.0, -2.0, 1.0, 0.5])


def test_repetition_penalty_can_change_the_greedy_choice():
    logits = np.array([[2.0, 1.5, 0.0]], np.float32)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    assert sample(logits, params, [np.random.default_rng(0)], [[0]]).tolist() == [1]
    assert logits[0, 0] == 2.0  # the caller's logits are left alone


def test_candidate_probs_apply_temperature_then_filters():
    logits = np.log(PROBS).astype(np.float32)
    ids, probs = candidate_probs(logits, SamplingParams(temperature=0.5))
    expected = PROBS**2 / (PROBS**2).sum()
    assert ids.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(probs, expected, rtol=1e-6)

    shuffled = logits[[3, 1, 2, 0]]  # probs 0.05, 0.3, 0.15, 0.5
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.75)
    ids, probs = candidate_probs(shuffled, params)  # top-k leaves ids 1, 2, 3
    assert ids.tolist() == [1, 2, 3]
    np.testing.assert_allclose(probs, [0.3 / 0.8, 0, 0.5 / 0.8], rtol=1e-6)


def test_sampling_matches_the_distribution():
    logits = np.log(PROBS).astype(np.float32)[None]
    params = [SamplingParams(temperature=1.0)]
    gen = np.random.default_rng(0)
    draws = [int(sample(logits, params, [gen], [[]])[0]) for _ in range(4000)]
    frequencies = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(frequencies, PROBS, atol=0.03)


def test_masked_tokens_are_never_drawn():
    logits = np.zeros((1, 50), np.float32)
    logits[0, 10:13] = 1.0
    params = [SamplingParams(temperature=2.0, top_k=3)]
    gen = np.random.default_rng(1)
    draws = {int(sample(logits, params, [gen], [[]])[0]) for _ in range(300)}
    assert draws == {10, 11, 12}


def test_a_seeded_request_samples_the_same_in_any_batch():
    rng = np.random.default_rng(123)
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    others = [SamplingParams(temperature=1.3, seed=s) for s in range(3)]
    logits = rng.standard_normal((5, 4, 100)).astype(np.float32)  # 5 steps, 4 rows

    alone_gen = np.random.default_rng(target.seed)
    alone = [sample(step[:1], [target], [alone_gen], [[]])[0] for step in logits]

    gens = [np.random.default_rng(target.seed)] + [np.random.default_rng(p.seed) for p in others]
    batched = []
    for step in logits:
        # The target row moves around the batch, next to rows drawing their own numbers.
        order = [1, 0, 2, 3] if len(batched) % 2 else [0, 1, 2, 3]
        params = [([target] + others)[i] for i in order]
        rows = step[order]
        tokens = sample(rows, params, [gens[i] for i in order], [[]] * 4)
        batched.append(tokens[order.index(0)])
    assert batched == alone


def test_log_softmax_rows_sum_to_one():
    logits = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32) * 10
    out = log_softmax(logits)
    assert out.dtype == np.float32
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": -3}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_from_generation_config():
    params = SamplingParams.from_generation_config(
        {"do_sample": False, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "x": 1}
    )
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.9, 5)
    assert SamplingParams(stop="ab").stop == ["ab"]
