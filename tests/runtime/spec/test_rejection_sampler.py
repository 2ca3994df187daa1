from __future__ import annotations

import numpy as np

from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.spec.rejection_sampler import verify_drafts

GREEDY = SamplingParams(temperature=0.0)


def one_hot_logits(token_ids: list[int], vocab: int = 8) -> np.ndarray:
    logits = np.zeros((len(token_ids), vocab), dtype=np.float32)
    logits[np.arange(len(token_ids)), token_ids] = 5.0
    return logits


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_corrects():
    logits = one_hot_logits([3, 4, 6, 1])  # target argmax after each draft
    rng = np.random.default_rng(0)
    assert verify_drafts(logits, [3, 4, 5], None, GREEDY, rng, [0]) == [3, 4, 6]
    assert verify_drafts(logits, [3, 4, 6], None, GREEDY, rng, [0]) == [3, 4, 6, 1]  # + bonus
    assert verify_drafts(logits, [2, 4, 6], None, GREEDY, rng, [0]) == [3]


def test_a_draft_the_target_cannot_produce_is_always_replaced():
    logits = np.full((2, 8), -np.inf, dtype=np.float32)
    logits[:, 1:3] = 0.0  # target: tokens 1 and 2, equally likely
    q = np.zeros((1, 8))
    q[0, 5] = 1.0
    params = SamplingParams(temperature=1.0)
    for seed in range(20):
        (token,) = verify_drafts(logits, [5], q, params, np.random.default_rng(seed), [0])
        assert token in (1, 2)


def test_a_draft_equal_to_the_target_is_always_accepted():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    p = np.exp(logits[:2] - logits[:2].max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for seed in range(20):
        drafts = [int(np.argmax(p[0])), int(np.argmax(p[1]))]
        out = verify_drafts(logits, drafts, p, params, np.random.default_rng(seed), [0])
        assert out[:2] == drafts and len(out) == 3
