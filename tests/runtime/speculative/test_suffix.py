"""Suffix (frequency n-gram) drafting: what it drafts, and that outputs stay exact."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_fakes import VOCAB_SIZE, FakeModel, fake_logits, reference_greedy, run_engine
from test_speculative_engine import GREEDY, imperfect_logits, prompts, run_checked

from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.manifest import NgramDraftSpec
from llmopt.runtime.speculative.drafter import FallbackDrafter, ModelDrafter, SuffixDrafter
from llmopt.runtime.speculative.speculator import Speculator, make_ngram_drafter
from llmopt.runtime.speculative.suffix import NgramIndex, SuffixSettings, suffix_draft, suffix_tree


def draft(tokens: list[int], k: int = 8, corpus: list[int] | None = None,
          **settings) -> tuple[list[int], str]:
    indexes = [("ngram", NgramIndex(8, tokens))]
    if corpus is not None:
        indexes.append(("corpus", NgramIndex(8, corpus)))
    return suffix_draft(tokens, indexes, k, SuffixSettings(**settings))


def test_the_most_frequent_follower_wins_over_the_latest():
    # "7 8" was followed by 1 twice, then by 2 once (the latest): prompt lookup would say 2.
    tokens, source = draft([7, 8, 1, 5, 7, 8, 1, 6, 7, 8, 2, 9, 7, 8], k=1)
    assert tokens == [1] and source == "ngram2"


def test_an_ambiguous_match_drafts_nothing_and_a_consistent_one_drafts_far():
    # "3" was followed by 4, 5, 6 and 7: a 1-in-4 guess is below the confidence floor.
    assert draft([3, 4, 3, 5, 3, 6, 3, 7, 3]) == ([], "")
    passage = list(range(10, 30))
    tokens, source = draft(passage + [1] + passage[:4], k=8, length_per_match=2.0)
    assert tokens == passage[4:12] and source == "ngram4"


def test_the_draft_grows_no_longer_than_the_match_allows():
    tokens, _ = draft([5, 6, 7, 8, 9, 5], k=8, length_per_match=1.0)
    assert tokens == [6]  # a 1-token match drafts one token
    tokens, _ = draft([5, 6, 7, 8, 9, 5], k=8, length_per_match=3.0)
    assert tokens == [6, 7, 8]


def test_the_corpus_drafts_what_the_sequence_has_not_seen_and_yields_to_it():
    corpus = [40, 41, 42, 43, 44, 45]
    assert draft([1, 2, 40, 41], corpus=corpus, k=3) == ([42, 43], "corpus2")
    # At equal match length the sequence's own followers come first.
    assert draft([40, 41, 50, 40, 41], corpus=corpus, k=1) == ([50], "ngram2")


def test_the_index_extends_and_rebuilds_when_the_sequence_is_not_an_extension():
    index = NgramIndex(3, [1, 2, 3])
    index.sync([1, 2, 3, 1, 2])
    assert index.followers[(1, 2)] == {3: 1}
    assert index.followers[(3,)] == {1: 1}
    index.sync([9, 2])
    assert index.tokens == [9, 2] and index.followers == {(9,): {2: 1}}


def test_the_manifest_picks_the_drafter_and_refuses_a_bad_corpus(tmp_path):
    assert type(make_ngram_drafter(None, NgramDraftSpec())).__name__ == "NgramDrafter"
    spec = NgramDraftSpec(method="suffix", max_n=6, corpus="corpus.npy")
    np.save(tmp_path / "corpus.npy", np.arange(20, dtype=np.int64))
    drafter = make_ngram_drafter(tmp_path, spec)
    assert isinstance(drafter, SuffixDrafter) and drafter.corpus.tokens == list(range(20))
    np.save(tmp_path / "corpus.npy", np.zeros((2, 2)))
    with pytest.raises(ValueError, match="not a 1-D array of token ids"):
        make_ngram_drafter(tmp_path, spec)


def suffix_engine(*, model: bool, corpus: list[int] | None = None, num_blocks: int = 128,
                  max_context: int = 96) -> LLMEngine:
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=16,
                          max_num_batched_tokens=64, max_context=max_context)
    kv = KVCacheManager(num_blocks, 4, True)
    drafter = SuffixDrafter(SuffixSettings(max_n=4, min_confidence=0.2,
                                           length_per_match=2.0), corpus)
    if model:
        drafter = FallbackDrafter(drafter, ModelDrafter(
            FakeModel(num_blocks, 4, imperfect_logits), kv, VOCAB_SIZE))
    target = FakeModel(num_blocks, 4, fake_logits)
    return LLMEngine(target, config, kv_cache_manager=kv, speculator=Speculator(drafter, 3))


@pytest.mark.parametrize("model", [False, True])
def test_suffix_drafts_give_the_plain_greedy_output_at_batch_1_and_16(model):
    repetitive = [[5, 6, 7, 8, 9] * 4, [10, 11, 12] * 5 + [13]]
    corpus = [t for p in prompts(8, seed=3) for t in p]
    for batch in (repetitive[:1], repetitive + prompts(14, seed=2)):
        engine = suffix_engine(model=model, corpus=corpus)
        outputs = run_checked(engine, batch, GREEDY)
        for prompt, output in zip(batch, outputs, strict=True):
            assert output.token_ids == reference_greedy(prompt, GREEDY.max_tokens)
        assert sum(o.metrics.speculation.num_draft_tokens for o in outputs) > 0


def test_suffix_drafts_are_exact_under_preemption():
    engine = suffix_engine(model=False, num_blocks=31, max_context=48)
    batch = [[5, 6, 7, 8, 9] * 3] + prompts(15, seed=5)
    outputs = run_checked(engine, batch, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == reference_greedy(prompt, GREEDY.max_tokens)


# --- draft trees ------------------------------------------------------------------------
def tree(tokens: list[int], k: int = 8, **settings) -> tuple[list[int], list[int], str]:
    return suffix_tree(tokens, [("ngram", NgramIndex(8, tokens))], k, SuffixSettings(**settings))


def test_a_tree_keeps_the_second_follower_the_chain_drops():
    # "7 8" was followed by 1 twice and by 2 once: the chain drafts 1, the tree 1 and 2,
    # then what followed "8 1" (5 and 6 once each, 6 the latest) under 1.
    tokens = [7, 8, 1, 5, 7, 8, 1, 6, 7, 8, 2, 9, 7, 8]
    assert tree(tokens, k=3, min_confidence=0.3) == ([1, 6, 2], [-1, 0, -1], "ngram2")
    assert draft(tokens, k=3, min_confidence=0.3)[0][:1] == [1]


def test_without_a_second_candidate_the_tree_is_the_chain():
    passage = list(range(10, 30))
    tokens = passage + [1] + passage[:4]
    chain, source = draft(tokens, k=6, length_per_match=2.0)
    assert tree(tokens, k=6, length_per_match=2.0) == (chain, list(range(-1, 5)), source)
    assert tree([3, 4, 3, 5, 3, 6, 3, 7, 3]) == ([], [], "")  # every follower below the floor


def test_nodes_come_depth_first_best_child_first_within_budget_and_depth():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 5, 1]  # "1" -> 2 (3x), 5 (1x); "1 2" -> 3, 3, 4
    nodes, parents, _ = tree(tokens, k=4, min_confidence=0.1, length_per_match=2.0)
    assert nodes == [2, 3, 4, 5] and parents == [-1, 0, 0, -1]
    for k in range(5):
        assert len(tree(tokens, k=k, min_confidence=0.1, length_per_match=2.0)[0]) <= k
    nodes, parents, _ = tree(tokens, k=8, min_confidence=0.1, length_per_match=1.0)
    assert all(p == -1 for p in parents)  # a 1-token match drafts one position deep


def bigram(token: int) -> int:
    """The fake target's greedy next token: a fixed permutation of 3..63."""
    return 3 + (token * 7 + 5) % (VOCAB_SIZE - 3)


def tree_engine(num_blocks: int = 128, plain: bool = False) -> LLMEngine:
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=16,
                          max_num_batched_tokens=64, max_context=96)
    kv = KVCacheManager(num_blocks, 4, True)
    drafter = SuffixDrafter(SuffixSettings(max_n=4, min_confidence=0.2,
                                           length_per_match=2.0), tree=True)
    model = FakeModel(num_blocks, 4, fake_logits, bigram)
    return LLMEngine(model, config, kv_cache_manager=kv,
                     speculator=None if plain else Speculator(drafter, 4))


def misleading_prompt(z: int, seed: int) -> list[int]:
    """A prompt ending in z: the target will follow it with a = bigram(z), and the prompt
    has a followed twice by a token the target never gives it, once by its own
    continuation; so at a the chain drafts the wrong token, a tree both."""
    rng = np.random.default_rng(seed)
    a = bigram(z)
    wrong = 3 + (bigram(a) + 4) % (VOCAB_SIZE - 3)
    filler = [int(t) for t in rng.integers(3, VOCAB_SIZE, 6)]
    return [a, wrong, filler[0], a, wrong, filler[1], a, bigram(a), bigram(bigram(a)),
            *filler[2:], z]


@pytest.mark.parametrize("batch,num_blocks", [(1, 256), (16, 256), (16, 40)])
def test_tree_drafts_accept_side_branches_and_give_the_plain_greedy_output(batch, num_blocks):
    """Side branches win (their entries moved into place: run_checked reads every computed
    position of the pool back), and batching and preemption change nothing."""
    prompt_list = [misleading_prompt(3 + i, seed=i) for i in range(batch)]
    plain = [o.token_ids for o in run_engine(tree_engine(plain=True), prompt_list, GREEDY)]
    engine = tree_engine(num_blocks)
    moves = []
    move = engine.executor.move_entries
    engine.executor.move_entries = lambda *args: (moves.append(args), move(*args))
    outputs = run_checked(engine, prompt_list, GREEDY)
    assert [o.token_ids for o in outputs] == plain
    assert moves and sum(o.metrics.speculation.num_accepted_tokens for o in outputs) > 0
    assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 40)
