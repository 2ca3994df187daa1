"""Speculative decoding in the engine, over FakeModel targets and drafts.

Both models read their own KV pools through the shared block tables, so a draft that
reads stale or missing entries, or a target that keeps a rejected token, shows up in
the outputs or in the pool checks below.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from runtime_fakes import (
    VOCAB_SIZE,
    FakeModel,
    drain,
    fake_logits,
    history_hash,
    make_engine,
    reference_greedy,
    run_engine,
)
from scipy.stats import chisquare

from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.kv.block_pool import hash_block_tokens
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.sampler import draw, token_probs
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.speculative import speculator as speculator_module
from llmopt.runtime.speculative.drafter import FallbackDrafter, ModelDrafter, NgramDrafter, Proposal
from llmopt.runtime.speculative.speculator import Speculator

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def imperfect_logits(h: int) -> np.ndarray:
    """The target's logits, except that every third history gets another argmax."""
    logits = fake_logits(h)
    if h % 3 == 0:
        logits = np.roll(logits, 1)
    return logits


def make_spec_engine(
    draft_fn: Callable[[int], np.ndarray] | None = imperfect_logits,
    *,
    gamma: int = 3,
    ngram: bool = False,
    target_fn: Callable[[int], np.ndarray] = fake_logits,
    block_size: int = 4,
    num_blocks: int = 128,
    max_num_batched_tokens: int = 64,
    max_context: int = 96,
    max_batch_size: int | None = None,
    enable_prefix_caching: bool = True,
) -> LLMEngine:
    config = EngineConfig(
        block_size=block_size, num_blocks=num_blocks, max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens, max_context=max_context,
        enable_prefix_caching=enable_prefix_caching,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    drafter = None
    if draft_fn is not None:
        drafter = ModelDrafter(FakeModel(num_blocks, block_size, draft_fn), kv, VOCAB_SIZE)
    if ngram:
        drafter = NgramDrafter(1, 3) if drafter is None else FallbackDrafter(
            NgramDrafter(1, 3), drafter)
    target = FakeModel(num_blocks, block_size, target_fn)
    return LLMEngine(target, config, kv_cache_manager=kv,
                     speculator=Speculator(drafter, gamma, max_batch_size))


def prompts(count: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB_SIZE, shared_prefix).tolist()
    return [prefix + rng.integers(3, VOCAB_SIZE, int(rng.integers(3, 20))).tolist()
            for _ in range(count)]


def check_pools(engine: LLMEngine) -> None:
    """Every computed position of every running request holds its token, in the target's
    pool and (up to its draft count) in the draft's."""
    drafter = engine.speculator.drafter
    draft = drafter.second if isinstance(drafter, FallbackDrafter) else drafter
    for request in engine.scheduler.running:
        kv = engine.kv_cache_manager
        tokens = np.asarray(request.all_token_ids)
        n = request.num_computed_tokens
        np.testing.assert_array_equal(
            engine.executor.tokens_at(kv.slot_mapping(request, 0, n)), tokens[:n])
        if isinstance(draft, ModelDrafter):
            d = draft.trailing.num_computed(request)
            assert d <= n
            np.testing.assert_array_equal(
                draft.executor.tokens_at(kv.slot_mapping(request, 0, d)), tokens[:d])
        check_cached_blocks(engine, request)


def check_cached_blocks(engine: LLMEngine, request) -> None:
    """A block in the prefix cache holds computed, accepted tokens: its hash is the chain
    hash of the request's own tokens there, and it lies within the computed ones."""
    bs = engine.kv_cache_manager.block_size
    table = engine.kv_cache_manager.block_tables[request.request_id]
    parent = None
    for i, block in enumerate(table[: request.num_tokens // bs]):
        parent = hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs])
        if block.block_hash is not None:
            assert (i + 1) * bs <= request.num_computed_tokens
            assert block.block_hash == parent


def run_checked(engine: LLMEngine, prompt_list, params) -> list:
    ids = [engine.add_request(p, params) for p in prompt_list]
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        check_pools(engine)
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("num_prompts", [1, 16])
def test_greedy_speculation_gives_the_plain_greedy_output(num_prompts):
    engine = make_spec_engine()
    batch = prompts(num_prompts, seed=num_prompts, shared_prefix=8)
    outputs = run_checked(engine, batch, GREEDY)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == reference_greedy(prompt, GREEDY.max_tokens)
    spec = [o.metrics.speculation for o in outputs]
    accepted = sum(s.num_accepted_tokens for s in spec)
    drafted = sum(s.num_draft_tokens for s in spec)
    assert 0 < accepted < drafted  # both acceptance and rejection happened
    assert all(s.tokens_per_step(GREEDY.max_tokens) > 1.2 for s in spec)


def test_a_perfect_draft_is_always_accepted():
    engine = make_spec_engine(fake_logits, gamma=4)
    (output,) = run_checked(engine, prompts(1, seed=3), GREEDY)
    spec = output.metrics.speculation
    assert spec.acceptance_rate == 1.0
    # 24 tokens = 1 from the prefill step + speculative steps of up to 5 each.
    assert spec.num_decode_steps <= 1 + -(-23 // 5)


def test_greedy_speculation_under_preemption_gives_the_plain_output():
    # 30 usable blocks of 4 slots: 16 requests of up to ~48 tokens cannot all fit.
    engine = make_spec_engine(num_blocks=31, max_context=48)
    batch = prompts(16, seed=5)
    outputs = run_checked(engine, batch, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == reference_greedy(prompt, GREEDY.max_tokens)


def test_ngram_and_fallback_drafts_give_the_plain_output():
    repetitive = [[5, 6, 7, 8, 9] * 4, [10, 11, 12] * 5 + [13]]
    for engine in (make_spec_engine(None, ngram=True), make_spec_engine(ngram=True)):
        outputs = run_checked(engine, repetitive, GREEDY)
        for prompt, output in zip(repetitive, outputs, strict=True):
            assert output.token_ids == reference_greedy(prompt, GREEDY.max_tokens)


def test_rejected_tokens_never_reach_the_prefix_cache():
    """run_checked checks every cached block's hash against the accepted tokens after
    every step; a second run over the same prompts hits those blocks."""
    engine = make_spec_engine()
    batch = prompts(4, seed=7)
    run_checked(engine, batch, GREEDY)
    outputs = run_checked(engine, batch, GREEDY)
    assert sum(o.metrics.num_cached_tokens for o in outputs) > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == reference_greedy(prompt, GREEDY.max_tokens)


def test_speculation_switches_off_above_the_batch_size_limit():
    engine = make_spec_engine(max_batch_size=2)
    outputs = run_checked(engine, prompts(6, seed=9), GREEDY)
    # While 6 run together there is no speculation; as they finish it comes back.
    running = len(engine.scheduler.running)
    assert engine.speculator.max_drafts(running) is None or not running
    steps = [o.metrics.speculation for o in outputs]
    assert sum(s.num_spec_steps for s in steps) < sum(s.num_decode_steps for s in steps) - 6


def test_stop_tokens_inside_accepted_drafts_end_the_request_there():
    plain = make_engine()
    spec = make_spec_engine(fake_logits, gamma=4)
    batch = prompts(4, seed=11)
    reference = run_engine(plain, batch, GREEDY)
    stop = [o.token_ids[5] for o in reference]
    for prompt, ref, stop_id in zip(batch, reference, stop, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id])
        (out,) = run_checked(spec, [prompt], params)
        end = ref.token_ids.index(stop_id) + 1
        assert out.token_ids == ref.token_ids[:end]
        assert out.finish_reason == "stop"


def test_max_tokens_is_never_exceeded():
    engine = make_spec_engine(fake_logits, gamma=6)
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = run_checked(engine, prompts(1, seed=max_tokens), params)
        assert len(out.token_ids) == max_tokens


# ---------------------------------------------------------------- sampling is exact
SMALL_VOCAB = 4  # target support: tokens 3..6


def small_target(h: int) -> np.ndarray:
    rng = np.random.default_rng(h)
    logits = np.full(VOCAB_SIZE, -np.inf, dtype=np.float32)
    logits[3 : 3 + SMALL_VOCAB] = rng.standard_normal(SMALL_VOCAB) * 1.5
    return logits


def poor_draft(h: int) -> np.ndarray:
    """A draft that disagrees with the target and also proposes a token it never makes."""
    rng = np.random.default_rng(h + 12345)
    logits = np.full(VOCAB_SIZE, -np.inf, dtype=np.float32)
    logits[3 : 4 + SMALL_VOCAB] = rng.standard_normal(SMALL_VOCAB + 1) * 1.5
    return logits


def exact_pair_distribution(prompt: list[int]) -> dict[tuple[int, int], float]:
    params = SamplingParams(temperature=1.0)
    p1 = token_probs(small_target(history_hash(prompt)), params, prompt)
    pairs = {}
    for a in np.flatnonzero(p1):
        p2 = token_probs(small_target(history_hash([*prompt, a])), params, [*prompt, a])
        for b in np.flatnonzero(p2):
            pairs[(int(a), int(b))] = p1[a] * p2[b]
    return pairs


def first_two_tokens(num_samples: int) -> tuple[Counter, dict, float]:
    prompt = [7, 8, 9]
    engine = make_spec_engine(poor_draft, gamma=3, target_fn=small_target,
                              enable_prefix_caching=False, max_num_batched_tokens=256)
    ids = [engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=3, seed=s))
           for s in range(num_samples)]
    outputs = drain(engine, ids)
    counts = Counter(tuple(o.token_ids[:2]) for o in outputs)
    drafted = sum(o.metrics.speculation.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.speculation.num_accepted_tokens for o in outputs)
    return counts, exact_pair_distribution(prompt), accepted / drafted


def chi_square_p_value(counts: Counter, exact: dict) -> float:
    assert set(counts) <= set(exact), "a pair the target can never produce was sampled"
    cells = sorted(exact)
    observed = np.array([counts.get(c, 0) for c in cells], dtype=np.float64)
    expected = np.array([exact[c] for c in cells]) * observed.sum()
    return float(chisquare(observed, expected).pvalue)


def rule(accept: str, replace: str):
    """A verification rule built from an acceptance test and a replacement distribution,
    to show which combinations keep the target's distribution."""

    def verify(target_logits, draft_token_ids, draft_probs, params, generator, seen):
        seen, emitted = list(seen), []
        for i, draft in enumerate(draft_token_ids):
            p, q = token_probs(target_logits[i], params, seen), draft_probs[i]
            keep = p[draft] if accept == "p" else min(1.0, p[draft] / q[draft])
            if generator.random() < keep:
                emitted.append(draft)
                seen.append(draft)
                continue
            if replace == "p without x":
                p[draft] = 0.0
            elif replace == "residual":
                p = np.maximum(p - q, 0.0)
            emitted.append(draw(p, generator))
            return emitted
        last = token_probs(target_logits[len(draft_token_ids)], params, seen)
        emitted.append(draw(last, generator))
        return emitted

    return verify


NUM_SAMPLES = 3000


def test_sampling_with_a_poor_draft_matches_the_target_distribution():
    counts, exact, acceptance = first_two_tokens(NUM_SAMPLES)
    assert 0.1 < acceptance < 0.9  # rejections happen, so the residual path is exercised
    assert chi_square_p_value(counts, exact) > 0.01


@pytest.mark.parametrize("accept, replace", [("min(1, p/q)", "p"), ("p", "p")])
def test_wrong_rules_fail_the_same_check(monkeypatch, accept, replace):
    """Proof the check has teeth: resampling from p instead of the residual biases the
    output towards the draft's choices."""
    monkeypatch.setattr(speculator_module, "verify_drafts", rule(accept, replace))
    counts, exact, _ = first_two_tokens(NUM_SAMPLES)
    assert chi_square_p_value(counts, exact) < 0.01


def test_the_tutorial_rule_is_exact_but_accepts_less(monkeypatch):
    """The issue's "tutorial rule" (keep x with probability p(x), else draw from p without
    x) turns out to be distribution-preserving: P(z) = q(z)p(z) + sum over x != z of
    q(x)(1 - p(x)) p(z) / (1 - p(x)) = p(z). It is wasteful rather than wrong: it keeps
    sum(q p) of the drafts where the exact rule keeps sum(min(p, q))."""
    _, _, exact_rule_acceptance = first_two_tokens(NUM_SAMPLES)
    monkeypatch.setattr(speculator_module, "verify_drafts", rule("p", "p without x"))
    counts, exact, tutorial_acceptance = first_two_tokens(NUM_SAMPLES)
    assert chi_square_p_value(counts, exact) > 0.01
    assert tutorial_acceptance < exact_rule_acceptance - 0.05


class FixedTree:
    """Proposes the same deterministic tree every step: three candidates after the last
    token (7 is one the target never makes), two under the first, one under the third."""

    TOKENS, PARENTS = [3, 4, 5, 7, 4, 6], [-1, 0, 0, -1, -1, 4]

    def propose(self, requests, max_tokens, budget=None):
        return [Proposal(self.TOKENS[:k], parents=self.PARENTS[:k]) for k in max_tokens]


def first_two_tokens_from_trees(num_samples: int) -> tuple[Counter, dict, float]:
    prompt = [7, 8, 9]
    config = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=16,
                          max_num_batched_tokens=256, max_context=96,
                          enable_prefix_caching=False)
    engine = LLMEngine(FakeModel(256, 4, small_target), config,
                       kv_cache_manager=KVCacheManager(256, 4, False),
                       speculator=Speculator(FixedTree(), 6))
    ids = [engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=s))
           for s in range(num_samples)]
    outputs = drain(engine, ids)
    # the first token comes from the prompt's step; the tree decides the next two
    counts = Counter(tuple(o.token_ids[:3]) for o in outputs)
    accepted = sum(o.metrics.speculation.num_accepted_tokens for o in outputs)
    return counts, exact_sequence_distribution(prompt, 3), accepted / num_samples


def exact_sequence_distribution(prompt: list[int], length: int) -> dict[tuple, float]:
    params = SamplingParams(temperature=1.0)
    sequences: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        longer = {}
        for tokens, prob in sequences.items():
            seen = [*prompt, *tokens]
            p = token_probs(small_target(history_hash(seen)), params, seen)
            for token in np.flatnonzero(p):
                longer[(*tokens, int(token))] = prob * p[token]
        sequences = longer
    return sequences


def test_sampling_through_draft_trees_matches_the_target_distribution():
    counts, exact, accepted_per_request = first_two_tokens_from_trees(NUM_SAMPLES)
    assert accepted_per_request > 1.0  # candidates beyond the first are kept too
    assert chi_square_p_value(counts, exact) > 0.01


def test_trying_every_candidate_against_the_full_distribution_fails_the_check(monkeypatch):
    """Proof the check has teeth: a second candidate tried with probability p(c) instead
    of p(c) / (1 - p(first)) under-samples it."""

    def careless(logits, tokens, parents, params, generator, seen):
        seen, emitted, path, node = list(seen), [], [], -1
        while True:
            p = token_probs(logits[node + 1], params, seen)
            children = [c for c, parent in enumerate(parents) if parent == node]
            kept = next((c for c in children if generator.random() < p[tokens[c]]), None)
            if kept is None:
                p[[tokens[c] for c in children]] = 0.0
                emitted.append(draw(p, generator))
                return emitted, path
            emitted.append(tokens[kept])
            path.append(kept)
            seen.append(tokens[kept])
            node = kept

    monkeypatch.setattr(speculator_module, "verify_tree", careless)
    counts, exact, _ = first_two_tokens_from_trees(NUM_SAMPLES)
    assert chi_square_p_value(counts, exact) < 0.01


def sampled_tokens(engine: LLMEngine, batch: Sequence[list[int]], seed: int) -> list[list[int]]:
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=seed + i)
              for i in range(len(batch))]
    return [o.token_ids for o in run_engine(engine, batch, params)]


def test_seeded_sampling_with_speculation_is_reproducible():
    batch = prompts(4, seed=13)
    first = sampled_tokens(make_spec_engine(), batch, seed=100)
    again = sampled_tokens(make_spec_engine(), batch, seed=100)
    assert first == again
