import numpy as np
import pytest
from runtime_fakes import (
    fake_logits,
    history_hash,
    make_engine,
    make_word_tokenizer,
    reference_greedy,
    run_engine,
)

from llmopt.runtime.engine import EngineConfig
from llmopt.runtime.sampler import log_softmax
from llmopt.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def workload(num: int = 16, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of varied lengths, half sharing a 21-token prefix; greedy and seeded sampling."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 64, 21).tolist()
    prompts, params = [], []
    for i in range(num):
        own = rng.integers(3, 64, int(rng.integers(1, 30))).tolist()
        prompts.append(shared + own if i % 2 else own)
        max_tokens = int(rng.integers(1, 20))
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens))
        else:
            params.append(
                SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=max_tokens)
            )
    return prompts, params


def one_at_a_time(prompts, params, **engine_kwargs):
    return [
        run_engine(make_engine(**engine_kwargs), [p], [sp])[0]
        for p, sp in zip(prompts, params, strict=True)
    ]


def test_greedy_output_matches_the_model_computed_directly():
    engine = make_engine()
    prompt = [5, 9, 11, 3, 40, 41, 42]
    (out,) = run_engine(engine, [prompt], GREEDY)
    assert out.token_ids == reference_greedy(prompt, 12)
    assert out.finish_reason == "length"
    assert out.metrics.ttft is not None and out.metrics.ttft >= 0


def test_concurrent_requests_match_running_alone():
    prompts, params = workload()
    alone = one_at_a_time(prompts, params)
    engine = make_engine(num_blocks=200, max_num_batched_tokens=48)
    together = run_engine(engine, prompts, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in together] == [o.finish_reason for o in alone]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    for i in greedy:
        assert together[i].token_ids == reference_greedy(prompts[i], params[i].max_tokens)
    assert engine.kv_cache_manager.block_pool.num_free_blocks == 199  # everything freed
    # Admission spreads over steps, so later sharers hit the cached 21-token prefix.
    assert sum(o.metrics.num_cached_tokens == 20 for o in together) >= 4


def test_requests_joining_between_steps_match_running_alone():
    prompts, params = workload(seed=1)
    alone = one_at_a_time(prompts, params)
    engine = make_engine(num_blocks=200)
    ids, finished = [], {}
    pending = list(zip(prompts, params, strict=True))
    while pending or engine.has_unfinished_requests():
        for _ in range(2):  # two new requests join before every step
            if pending:
                prompt, sp = pending.pop(0)
                ids.append(engine.add_request(prompt, sp))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert [finished[i].token_ids for i in ids] == [o.token_ids for o in alone]


def test_prefix_cache_shares_blocks_and_changes_no_output():
    prompts, params = workload(seed=2)
    # One request first, so the shared prefix is cached before the others arrive.
    engine = make_engine(num_blocks=200)
    first = run_engine(engine, prompts[1:2], params[1:2])
    rest = run_engine(engine, prompts, params)
    shared = [o for i, o in enumerate(rest) if i % 2]
    # The shared 21 tokens fill 5 blocks of 4: every sharer reuses all 5.
    assert all(o.metrics.num_cached_tokens >= 20 for o in shared)
    assert all(o.metrics.num_cached_tokens == 0 for o in rest[::2])

    no_cache = make_engine(num_blocks=200, enable_prefix_caching=False)
    run_engine(no_cache, prompts[1:2], params[1:2])
    expected = run_engine(no_cache, prompts, params)
    assert [o.token_ids for o in rest] == [o.token_ids for o in expected]
    assert first[0].token_ids == rest[1].token_ids


def test_a_cached_prefix_is_referenced_not_copied():
    engine = make_engine(num_blocks=32)
    prefix = list(range(10, 26))  # 4 full blocks
    run_engine(engine, [prefix + [3]], GREEDY)
    pool = engine.kv_cache_manager.block_pool
    assert len(pool.cached_blocks) >= 4
    a = engine.add_request(prefix + [4, 5], GREEDY)
    b = engine.add_request(prefix + [6], GREEDY)
    engine.step()
    tables = engine.kv_cache_manager.block_tables
    table_a, table_b = (tables[i] for i in (a, b))
    assert table_a[:4] == table_b[:4]
    assert [blk.ref_count for blk in table_a[:4]] == [2, 2, 2, 2]
    assert table_a[4] is not table_b[4]


def test_preemption_under_a_small_pool_changes_no_output():
    prompts, params = workload(seed=3)
    alone = one_at_a_time(prompts, params)
    # 20 usable blocks of 4 tokens: one max-context sequence fits, all sixteen do not.
    engine = make_engine(num_blocks=21, max_context=80)
    together = run_engine(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in together) == engine.scheduler.num_preemptions
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_preemption_without_prefix_caching_changes_no_output():
    prompts, params = workload(seed=4)
    alone = one_at_a_time(prompts, params)
    engine = make_engine(num_blocks=21, max_context=80, enable_prefix_caching=False)
    together = run_engine(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_prefill_chunks_respect_the_token_budget():
    engine = make_engine(max_num_batched_tokens=8)
    prompt = list(range(3, 30))
    (out,) = run_engine(engine, [prompt], GREEDY)
    assert out.token_ids == reference_greedy(prompt, 12)
    assert max(engine.executor.step_sizes) == 8
    assert engine.executor.step_sizes[:4] == [8, 8, 8, 3]


def test_eos_stop_tokens_and_max_context():
    prompt = [5, 6, 7]
    expected = reference_greedy(prompt, 12)
    eos = expected[3]
    engine = make_engine(eos_token_ids=[eos])
    (out,) = run_engine(engine, [prompt], GREEDY)
    stop_at = expected.index(eos) + 1
    assert (out.token_ids, out.finish_reason) == (expected[:stop_at], "stop")

    (out,) = run_engine(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert (out.token_ids, out.finish_reason) == (expected, "length")

    stop_id = expected[5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    (out,) = run_engine(engine, [prompt], params)
    assert out.token_ids == expected[: expected.index(stop_id) + 1] and out.finish_reason == "stop"

    short = make_engine(max_context=8)
    (out,) = run_engine(short, [prompt], GREEDY)
    assert (out.token_ids, out.finish_reason) == (expected[:5], "length")


def test_stop_strings_cut_the_text_and_finish_the_request():
    tokenizer = make_word_tokenizer()
    prompt = [5, 6, 7]
    expected = reference_greedy(prompt, 12)
    full_text = tokenizer.decode(expected)
    stop = tokenizer.decode(expected[4:6])  # two words, e.g. "w12 w40"
    engine = make_engine(tokenizer=tokenizer)
    (out,) = run_engine(engine, [prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full_text[: full_text.index(stop)]
    assert out.token_ids == expected[:6]

    (out,) = run_engine(engine, [prompt], GREEDY)
    assert (out.text, out.finish_reason) == (full_text, "length")


def test_streamed_text_never_shows_part_of_a_stop_string():
    tokenizer = make_word_tokenizer()
    prompt = [5, 6, 7]
    expected = reference_greedy(prompt, 12)
    stop = tokenizer.decode(expected[6:8])
    engine = make_engine(tokenizer=tokenizer)
    request_id = engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    )
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step() if o.request_id == request_id]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert not any(stop[:2] in t[len(texts[-1]) :] for t in texts)
    assert texts[-1] == tokenizer.decode(expected)[: tokenizer.decode(expected).index(stop)]


def test_score_returns_next_token_logprobs_in_chunks():
    engine = make_engine(max_num_batched_tokens=8)
    tokens = list(range(3, 33))  # 30 tokens: four chunks
    request_id = engine.add_request(tokens, SamplingParams(), score_only=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    expected = [
        log_softmax(fake_logits(history_hash(tokens[: t + 1])))[tokens[t + 1]]
        for t in range(len(tokens) - 1)
    ]
    assert out.request_id == request_id and out.token_ids == []
    np.testing.assert_allclose(out.prompt_logprobs, expected, rtol=1e-6)
    assert engine.executor.step_sizes == [8, 8, 8, 6]


def test_too_long_prompt_is_a_clear_error():
    engine = make_engine(max_context=16)
    with pytest.raises(ValueError, match="prompt has 20 tokens but the max context is 16"):
        engine.add_request(list(range(20)), GREEDY)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("num_blocks", [0, 1, 4])
def test_a_pool_too_small_for_one_sequence_is_a_clear_error(num_blocks):
    with pytest.raises(ValueError, match=f"the KV pool has {num_blocks} blocks"):
        EngineConfig(
            block_size=4,
            num_blocks=num_blocks,
            max_num_seqs=1,
            max_num_batched_tokens=8,
            max_context=16,
        )
    EngineConfig(
        block_size=4, num_blocks=5, max_num_seqs=1, max_num_batched_tokens=8, max_context=16
    )


def test_abort_frees_blocks():
    engine = make_engine(num_blocks=17)
    request_id = engine.add_request(list(range(3, 20)), GREEDY)
    engine.step()
    assert engine.kv_cache_manager.block_pool.num_free_blocks == 16 - 5
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.block_pool.num_free_blocks == 16
