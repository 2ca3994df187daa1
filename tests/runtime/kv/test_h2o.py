"""H2O (kv.h2o): the native step's accumulated attention against a softmax reference, the
eviction rule (the lowest sums between the sinks and the recent window), equality with
full attention while a sequence fits, and kept entries equal to a fresh prefill's."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from lane_artifacts import (
    A8,
    BLOCK,
    RTN,
    RUNTIME,
    compile_artifacts,
    kv_codes,
    needs_native,
)
from runtime_fakes import greedy_params, random_prompt

from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM
from llmopt.runtime.kv.h2o import H2OConfig, kept_rows
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.native.library import KVLayout, kernels

H2O = H2OConfig(budget=32, recent=12, sinks=2)  # heavy hitters 18, drops of 4
ARTIFACTS = {  # name -> (passes, target options)
    "float32": ([RTN], A8),
    "int8": ([kv_codes("int8"), RTN], A8),
    "recipe": ([RTN], A8),  # with `runtime: h2o:` (RUNTIME below): attention sums too
    "recipe-int8": ([kv_codes("int8"), RTN], A8),
    "recipe-int4": ([kv_codes("int4"), RTN], A8),
}


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    return compile_artifacts(tiny_checkpoints["llama"], word_text,
                             tmp_path_factory.mktemp("h2o"), ARTIFACTS,
                             {"h2o": {"budget": H2O.budget, "recent": H2O.recent,
                                      "sinks": H2O.sinks}})


@needs_native
@pytest.mark.parametrize("bits", [32, 8])
def test_accumulated_attention_is_the_softmax_weights_summed(bits):
    """llmopt_attention_scored (5 query tokens of a group of 3 heads, the first after 40
    rows) adds to the sums, per row, each token's weights summed over its heads: float64
    softmax as the reference; int8 lanes weigh in 15-bit codes."""
    rng = np.random.default_rng(bits)
    n, group, first_len, dim = 5, 3, 41, 64
    length, scale = first_len + n - 1, dim ** -0.5
    q = (3 * rng.standard_normal((n, group, dim))).astype(np.float32)
    keys, values = (rng.standard_normal((length, dim)).astype(np.float32) for _ in range(2))
    scales = [np.abs(x).max(axis=0) / 127 for x in (keys, values)]
    if bits == 8:
        codes = [np.clip(np.round(x / s), -127, 127).astype(np.int8)
                 for x, s in zip((keys, values), scales, strict=True)]
        kv, keys = KVLayout(8, scales[0].ctypes.data, scales[1].ctypes.data, None), codes[0]
        values, seen_keys = codes[1], codes[0] * scales[0]
    else:
        kv, seen_keys = KVLayout(32, None, None, None), keys
    before = rng.random(length).astype(np.float32)  # sums it adds to
    sums = before.copy()
    out = np.empty((n, group, dim), np.float32)
    assert kernels().llmopt_attention_scored(ctypes.byref(kv), q.ctypes.data, n, group,
                                       keys.ctypes.data, values.ctypes.data, first_len, dim,
                                       scale, None, out.ctypes.data, sums.ctypes.data) == 0
    want = before.astype(np.float64)
    for i in range(n):
        seen = first_len + i
        scores = scale * q[i].astype(np.float64) @ seen_keys[:seen].T.astype(np.float64)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        want[:seen] += (weights / weights.sum(axis=1, keepdims=True)).sum(axis=0)
    np.testing.assert_allclose(sums, want, rtol=0, atol=1e-5 if bits == 32 else 5e-4)


def test_the_evicted_rows_are_the_lowest_sums_between_sinks_and_recent():
    rng = np.random.default_rng(0)
    sums = rng.random((2, 3, 40)).astype(np.float32)
    sinks, recent, drop = 2, 10, 5
    keep = kept_rows(sums, sinks, recent, drop)
    assert keep.shape == (2, 3, 35)
    for layer in range(2):
        for head in range(3):
            rows = keep[layer, head]
            assert np.all(np.diff(rows) > 0)
            evicted = sorted(set(range(40)) - set(rows.tolist()))
            candidates = sums[layer, head, sinks:40 - recent]
            lowest = sorted((np.argsort(candidates)[:drop] + sinks).tolist())
            assert evicted == lowest
    assert len({tuple(r) for r in keep.reshape(6, -1)}) > 1  # heads choose their own rows


@needs_native
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_h2o_equals_full_attention_while_the_sequence_fits(artifacts, kv):
    """Up to the budget nothing is evicted: tokens and log-probs are the normal path's,
    on a prompt prefilled in one chunk and one in several (every step accumulating)."""
    for length in (9, 20):  # 20: over H2O's step budget (heavy hitters less a drop: 14)
        params = greedy_params(H2O.budget - length)
        full = LLM(artifacts[kv], kernels="native", speculative=False).generate(
            random_prompt(length), params)[0]
        h2o = LLM(artifacts[kv], kernels="native", streaming=H2O).generate(
            random_prompt(length), params)[0]
        assert h2o.token_ids == full.token_ids
        assert [lp.logprob for lp in h2o.logprobs] == [lp.logprob for lp in full.logprobs]


@needs_native
def test_every_layer_adds_each_tokens_weights(artifacts):
    """Before any eviction each layer's sums over a lane's rows hold one unit per query
    token and query head of the group; rows past the entries hold nothing."""
    llm = LLM(artifacts["float32"], kernels="native", streaming=H2O)
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    engine.add_request(random_prompt(20), greedy_params(6))
    for _ in range(4):
        engine.step()
    [request] = engine.scheduler.running
    cached, lane = manager.cache_position(request), manager.lanes[request.request_id]
    sums = manager.streaming.sums[:, lane]
    np.testing.assert_allclose(sums[..., :cached].sum(axis=-1), cached * _group(llm),
                               rtol=1e-5)
    assert not sums[..., cached:].any()


def _group(llm: LLM) -> int:
    plan = llm.engine.executor.weights.model
    return plan.heads // plan.kv_heads


@needs_native
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_an_eviction_keeps_the_heavy_hitters_at_their_cache_positions(artifacts, kv, codes_close):
    """Step by step past the budget: at the first eviction every layer and KV head keeps
    all but the lowest sums between the sinks and the recent window (kept_rows on the
    sums before the step), their values moved as they were, and layer 0's keys (a token's
    key depends on it and its position only) those of a fresh prefill of the kept tokens
    (float32: float rounding; int8 codes: decoded, turned and rounded back, one code where
    nothing was clipped: conftest's codes_close)."""
    llm = LLM(artifacts[kv], kernels="native", streaming=H2O)
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    engine.add_request(random_prompt(20), greedy_params(40))
    engine.step()
    [request] = engine.scheduler.running
    lane, h2o = manager.lanes[request.request_id], manager.streaming
    pools = engine.executor.pools
    while not h2o.num_evicted(request.request_id):
        cached = manager.cache_position(request)
        sums = h2o.sums[:, lane, :, :cached].copy()
        values = {name: np.array(pools[name][lane, :, :cached]) for name in pools
                  if name.endswith(".value")}
        keys = np.array(pools["past.0.key"][lane, :, :cached])
        engine.step()
    drop = h2o.num_evicted(request.request_id)
    keep = kept_rows(sums, H2O.sinks, H2O.recent_size(), drop)
    for name, before in values.items():
        layer = int(name.split(".")[1])
        got = pools[name][lane, :, :cached - drop]
        np.testing.assert_array_equal(got, np.take_along_axis(before, keep[layer][..., None], 1))
    tokens = request.all_token_ids
    for head in range(keep.shape[1]):
        kept = [tokens[i] for i in keep[0, head]]
        fresh = LLM(artifacts[kv], kernels="native", speculative=False)
        fresh.engine.add_request(kept, greedy_params(2))
        fresh.engine.step()  # the prefill, in one step
        [running] = fresh.engine.scheduler.running
        fresh_lane = fresh.engine.kv_cache_manager.lanes[running.request_id]
        want = fresh.engine.executor.pools["past.0.key"][fresh_lane, head, :len(kept)]
        got = pools["past.0.key"][lane, head, :len(kept)]
        if kv == "float32":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            codes_close(got, want, keys[head, keep[0, head]], kv)


@needs_native
def test_generation_runs_past_the_context_within_the_budget(artifacts):
    llm = LLM(artifacts["int8"], kernels="native", streaming=H2O)
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    request_id = engine.add_request(random_prompt(20), greedy_params(300))
    held, outputs = [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        request = next(iter(engine.scheduler.running), None)
        if request is not None:
            held.append(manager.cache_position(request))
    [final] = [o for o in outputs if o.finished and o.request_id == request_id]
    assert len(final.token_ids) == 300
    assert max(held) <= H2O.budget and cdiv(max(held), BLOCK) <= H2O.budget // BLOCK
    assert llm.manifest.model.max_position < 20 + 300


@needs_native
def test_requests_batched_together_evict_as_each_would_alone(artifacts):
    """Two requests past the budget in one batch: each lane's sums and evictions are its
    own, so each produces the tokens it produces alone."""
    prompts, params = [random_prompt(20, seed=1), random_prompt(13, seed=2)], greedy_params(60)
    together = LLM(artifacts["float32"], kernels="native", streaming=H2O).generate(
        prompts, params)
    for alone_prompt, output in zip(prompts, together, strict=True):
        alone = LLM(artifacts["float32"], kernels="native", streaming=H2O).generate(
            alone_prompt, params)[0]
        assert output.token_ids == alone.token_ids


@pytest.mark.parametrize("config,error", [
    (H2OConfig(budget=32, recent=32), "must exceed the recent window"),
    (H2OConfig(budget=32, recent=28, sinks=4), "must exceed the recent window"),
    (H2OConfig(budget=128), "larger than the context"),
    (H2OConfig(budget=32, recent=24, drop=8), "at least two drops"),
    (H2OConfig(budget=32, drop=0), "drop 0 must be >= 1"),
])
def test_bad_h2o_settings_are_refused_in_one_line(artifacts, config, error):
    with pytest.raises(ValueError, match=error) as caught:
        LLM(artifacts["float32"], streaming=config)
    assert "\n" not in str(caught.value)


def test_onnx_runtime_without_attention_sums_is_refused_in_one_line(artifacts):
    """A graph compiled without `runtime: h2o` returns no attention weights."""
    with pytest.raises(ValueError, match="GroupQueryAttention returns none") as caught:
        LLM(artifacts["float32"], kernels="onnxruntime", streaming=H2O)
    assert "\n" not in str(caught.value)


def _sums_after(llm: LLM, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """Each request's accumulated attention [layers, kv_heads, cached] after `steps` steps
    (a prefill in chunks of 8, then decoding), none evicted yet."""
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    for prompt in prompts:
        engine.add_request(prompt, greedy_params(40))
    for _ in range(steps):
        engine.step()
    sums = []
    for request in engine.scheduler.running:
        assert manager.streaming.num_evicted(request.request_id) == 0
        lane = manager.lanes[request.request_id]
        sums.append(np.array(manager.streaming.sums[:, lane, :,
                                                    :manager.cache_position(request)]))
    return sums


@pytest.mark.parametrize("name", ["recipe", "recipe-int8", "recipe-int4"])
def test_onnx_runtime_accumulates_each_tokens_weights(artifacts, name):
    """A graph compiled for H2O returns each step's attention weights per KV head: before
    any eviction each layer's sums over a lane hold one unit per query token and head of
    the group (two requests batched, prefills in chunks: padding rows add nothing)."""
    llm = LLM(artifacts[name], kernels="onnxruntime", max_num_batched_tokens=8)
    assert llm.kernels_in_use() == "onnxruntime"
    group = 2  # the tiny llama's query heads per KV head
    for sums in _sums_after(llm, [random_prompt(13, seed=1), random_prompt(6, seed=2)], 5):
        np.testing.assert_allclose(sums.sum(axis=-1), sums.shape[-1] * group, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("name", ["recipe", "recipe-int8", "recipe-int4"])
def test_onnx_runtime_accumulates_what_the_native_step_does(artifacts, name):
    """The same requests on ONNX Runtime and the native step, batched, prefills in chunks:
    float32 and int4 lanes (decoded to float by both), the same sums within float rounding
    (3e-7 of the largest, measured); int8 lanes, within the native step's integer attention
    (its weights in 15-bit codes: up to 0.9 % of the largest sum, measured). And the same
    rows evicted from each layer and KV head by a drop of 2 (a recent window of 3: the
    shorter request holds 10 entries)."""
    prompts = [random_prompt(13, seed=1), random_prompt(6, seed=2)]
    got, want = (_sums_after(LLM(artifacts[name], kernels=k, max_num_batched_tokens=8),
                             prompts, 5) for k in ("onnxruntime", "native"))
    tolerance = 0.02 if name == "recipe-int8" else 1e-6
    for ort_sums, native_sums in zip(got, want, strict=True):
        largest = np.abs(native_sums).max()
        np.testing.assert_allclose(ort_sums, native_sums, rtol=0, atol=tolerance * largest)
        keep = [kept_rows(s, H2O.sinks, 3, 2) for s in (ort_sums, native_sums)]
        np.testing.assert_array_equal(*keep)


@needs_native
def test_a_recipe_evicts_heavy_hitters_unless_the_caller_turns_it_off(artifacts):
    on = LLM(artifacts["recipe"])
    assert on.engine.kv_cache_manager.streaming.config == H2O
    generated = on.generate(random_prompt(20), greedy_params(100))[0].token_ids
    assert len(generated) == 100  # past max_context
    off = LLM(artifacts["recipe"], streaming=False)
    assert off.engine.kv_cache_manager.streaming is None


@pytest.mark.parametrize("runtime,error", [
    ({"h2o": {"budget": 32, "recent": 32}}, "must exceed the recent window"),
    ({"h2o": {"budget": 100}}, "larger than max_context"),
    ({"h2o": {"budget": 32}, "streaming": {"window": 28}}, "one of streaming and h2o"),
])
def test_a_recipe_with_bad_h2o_fails_validation(tiny_checkpoints, runtime, error):
    with pytest.raises(ValueError, match=error):
        Recipe(model=str(tiny_checkpoints["llama"]), runtime={**RUNTIME, **runtime})


def test_onnx_runtime_runs_h2o_past_the_context(artifacts):
    """The recipe's H2O on ONNX Runtime: 100 tokens past a 64-token lane, never more than
    the budget held; with H2O off the same graph runs, its sums outputs left unbound."""
    llm = LLM(artifacts["recipe"], kernels="onnxruntime")
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    request_id = engine.add_request(random_prompt(20), greedy_params(100))
    held, outputs = [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held += [manager.cache_position(r) for r in engine.scheduler.running]
    [final] = [o for o in outputs if o.finished and o.request_id == request_id]
    assert len(final.token_ids) == 100 and max(held) <= H2O.budget
    off = LLM(artifacts["recipe"], kernels="onnxruntime", streaming=False)
    plain = LLM(artifacts["float32"], kernels="onnxruntime", speculative=False)
    params = greedy_params(20)
    assert (off.generate(random_prompt(9), params)[0].token_ids
            == plain.generate(random_prompt(9), params)[0].token_ids)


@needs_native
def test_onnx_runtime_sums_see_the_sliding_window(tiny_checkpoints, word_text, tmp_path):
    """The tiny Mistral (a window of 12 on every layer), requests past the window: ONNX
    Runtime's sums (its branch masks the window) equal the native step's (each query reads
    its window only) within float rounding: either reading keys outside would differ."""
    artifact = compile_artifacts(tiny_checkpoints["mistral"], word_text, tmp_path,
                                 {"recipe": ([RTN], A8)},
                                 {"h2o": {"budget": H2O.budget, "recent": H2O.recent,
                                          "sinks": H2O.sinks}})["recipe"]
    prompts = [random_prompt(20, seed=3), random_prompt(15, seed=4)]
    got, want = (_sums_after(LLM(artifact, kernels=k, max_num_batched_tokens=8), prompts, 5)
                 for k in ("onnxruntime", "native"))
    for ort_sums, native_sums in zip(got, want, strict=True):
        assert ort_sums.shape[-1] > 12
        np.testing.assert_allclose(ort_sums, native_sums, rtol=0,
                                   atol=1e-6 * np.abs(native_sums).max())
