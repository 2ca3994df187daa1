from __future__ import annotations

import numpy as np

from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.speculative.rejection_sampler import verify_drafts, verify_tree

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


def test_greedy_follows_the_tree_branch_the_target_agrees_with():
    # nodes: 3 (root child), 4 under 3, 5 (root child), 6 under 5, 1 under 6
    tokens, parents = [3, 4, 5, 6, 1], [-1, 0, -1, 2, 3]
    # rows: after the last known token, then after each node
    logits = one_hot_logits([5, 2, 2, 6, 1, 7])
    rng = np.random.default_rng(0)
    assert verify_tree(logits, tokens, parents, GREEDY, rng, [0]) == ([5, 6, 1, 7], [2, 3, 4])
    logits = one_hot_logits([3, 2, 2, 6, 1, 7])  # the first branch, rejected at its 2nd node
    assert verify_tree(logits, tokens, parents, GREEDY, rng, [0]) == ([3, 2], [0])
    logits = one_hot_logits([7, 2, 2, 6, 1, 7])  # no candidate: the target's token
    assert verify_tree(logits, tokens, parents, GREEDY, rng, [0]) == ([7], [])


def test_a_chain_shaped_tree_verifies_as_a_chain():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 8)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    for seed in range(20):
        chain = verify_drafts(logits, [1, 2, 3], None, params, np.random.default_rng(seed), [0])
        tree, path = verify_tree(logits, [1, 2, 3], [-1, 0, 1], params,
                                 np.random.default_rng(seed), [0])
        assert tree == chain and path == list(range(len(chain) - 1))
