"""Streaming generation past the context (kv.streaming) on tiny compiled checkpoints:
equal to full attention while a sequence fits, bounded memory past the context, and kept
keys turned back to exactly the keys their cache positions give."""

from __future__ import annotations

import json
import shutil
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
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.kv.streaming import StreamingConfig

KERNELS = ["onnxruntime", pytest.param("native", marks=needs_native)]
KV = ["float32", "float16", "int8", "int4"]
# each lanes format on both kernels, and float activations (no native plan) on ONNX Runtime
KV_KERNELS = [*((kv, "onnxruntime") for kv in KV),
              *(pytest.param(kv, "native", marks=needs_native) for kv in KV),
              ("float-activations", "onnxruntime")]
STREAM = StreamingConfig(sinks=4, window=28)  # 32 positions: 8 blocks of 4
ARTIFACTS = {  # name -> (passes, target options)
    "float32": ([RTN], A8),
    "float16": ([{"kv_cache": {"dtype": "float16"}}, RTN], A8),
    "int8": ([kv_codes("int8"), RTN], A8),
    "int4": ([kv_codes("int4"), RTN], A8),
    "blocks": ([RTN], {**A8, "kv_layout": "blocks"}),
    "float-activations": ([RTN], {}),  # no native plan: the rotary tables beside the reason
    "recipe": ([RTN], A8),  # with `runtime: streaming:` (RUNTIME below)
}


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    return compile_artifacts(tiny_checkpoints["llama"], word_text,
                             tmp_path_factory.mktemp("streaming"), ARTIFACTS,
                             {"streaming": {"sinks": STREAM.sinks, "window": STREAM.window}})


@pytest.mark.parametrize("kv,kernel", KV_KERNELS)
def test_streaming_equals_full_attention_while_the_sequence_fits(artifacts, kv, kernel):
    """Up to sinks + window tokens nothing is dropped: tokens and log-probs are the
    normal path's, on prompts prefilled in one chunk and in several."""
    if kv == "float-activations":  # ONNX Runtime's alone: the manifest names its tables
        native = LLM(artifacts[kv], kernels=kernel).manifest.graphs["target"].native
        assert native is not None and "unsupported" in native and set(native["rope"]) == {
            "cos", "sin"}
    for length in (9, 26):  # 26: over the streaming step budget (window - block = 24)
        params = greedy_params(STREAM.budget() - length)
        full = LLM(artifacts[kv], kernels=kernel, speculative=False).generate(
            random_prompt(length), params)[0]
        streamed = LLM(artifacts[kv], kernels=kernel, streaming=STREAM).generate(
            random_prompt(length), params)[0]
        assert streamed.token_ids == full.token_ids
        assert [lp.logprob for lp in streamed.logprobs] == [lp.logprob for lp in full.logprobs]


@pytest.mark.parametrize("stream", [STREAM, StreamingConfig(sinks=4, window=28, drop=8)])
@pytest.mark.parametrize("kv,kernel", [("float32", "onnxruntime"),
                                       pytest.param("float32", "native", marks=needs_native),
                                       ("float-activations", "onnxruntime")])
def test_generation_runs_past_the_context_in_fixed_memory(artifacts, kv, kernel, stream):
    """300 tokens past a 256-position model with a 64-token lane: at most the budget's
    blocks held at every step, every token produced (drops of one block and of two)."""
    llm = LLM(artifacts[kv], kernels=kernel, streaming=stream)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    request_id = engine.add_request(random_prompt(20), greedy_params(300))
    held, positions = [], []
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        request = next(iter(engine.scheduler.running), None)
        if request is not None:
            held.append(kv.blocks_held(request)["full"])
            positions.append(kv.cache_position(request))
    [final] = [o for o in outputs if o.finished and o.request_id == request_id]
    assert len(final.token_ids) == 300
    assert max(held) == cdiv(STREAM.budget(), BLOCK)
    assert max(positions) <= STREAM.budget()
    assert llm.manifest.model.max_position < 20 + 300


@pytest.mark.parametrize("kv,kernel", KV_KERNELS)
def test_kept_keys_are_the_keys_of_their_cache_positions(artifacts, kv, kernel, codes_close):
    """After drops, layer 0's entries (which depend on the token and its position only)
    equal a fresh prefill's of the kept tokens at positions 0 .. n-1: values exactly (float
    activations: within float rounding, a step's row count choosing the GEMM's sums), keys
    within one rounding of the turn (float16). int8/int4 codes (after one drop: decoded with
    their static scales, turned and rounded back): within one code wherever neither the
    code turned nor the fresh one was clipped (a clipped key lost what lay past the range
    when it was stored; no turn restores it)."""
    llm = LLM(artifacts[kv], kernels=kernel, streaming=STREAM)
    engine, manager = llm.engine, llm.engine.kv_cache_manager
    engine.add_request(random_prompt(20), greedy_params(60))
    streaming = manager.streaming
    codes = kv in ("int8", "int4")
    request, before = None, None
    while request is None or streaming.num_evicted(request.request_id) < (
            BLOCK if codes else 2 * BLOCK):
        if request is not None:
            before = np.array(engine.executor.pools["past.0.key"][
                manager.lanes[request.request_id], :, :manager.cache_position(request)])
        engine.step()
        request = engine.scheduler.running[0]
    cached = manager.cache_position(request)
    dropped = streaming.num_evicted(request.request_id)
    tokens = request.all_token_ids
    kept = tokens[:STREAM.sinks] + tokens[STREAM.sinks + dropped:request.num_computed_tokens]
    assert len(kept) == cached
    lane = manager.lanes[request.request_id]
    pools = engine.executor.pools
    got = {name: np.array(pools[f"past.0.{name}"][lane, :, :cached]) for name in ("key", "value")}

    fresh = LLM(artifacts[kv], kernels=kernel, speculative=False)
    fresh.engine.add_request(kept, greedy_params(2))
    fresh.engine.step()  # the prefill, in one step
    [running] = fresh.engine.scheduler.running
    fresh_lane = fresh.engine.kv_cache_manager.lanes[running.request_id]
    want = {name: fresh.engine.executor.pools[f"past.0.{name}"][fresh_lane, :, :cached]
            for name in ("key", "value")}
    if kv == "float-activations":  # float GEMMs round by how many rows a step holds
        np.testing.assert_allclose(got["value"], want["value"], rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got["value"], want["value"])
    if codes:
        assert before is not None
        moved = np.concatenate([np.arange(STREAM.sinks),
                                np.arange(STREAM.sinks + dropped, before.shape[1])])
        source = np.concatenate([before[:, moved], want["key"][:, moved.size:]], axis=1)
        assert np.array_equal(got["key"][:, :STREAM.sinks], want["key"][:, :STREAM.sinks])
        codes_close(got["key"], want["key"], source, kv)
        return
    tolerance = 2e-3 if kv == "float16" else 1e-5  # float16: one rounding of the turn
    np.testing.assert_allclose(got["key"], want["key"], rtol=tolerance, atol=tolerance)




@pytest.mark.parametrize("config,error", [
    (StreamingConfig(sinks=4, window=64), "larger than the context"),
    (StreamingConfig(sinks=8, window=8), "below the window"),
    (StreamingConfig(sinks=2, window=6), "at least two drops"),
    (StreamingConfig(sinks=2, window=16, drop=6), "whole number of blocks"),
])
def test_bad_streaming_settings_are_refused_in_one_line(artifacts, config, error):
    with pytest.raises(ValueError, match=error) as caught:
        LLM(artifacts["float32"], streaming=config)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("kv,error", [("blocks", "lanes KV layout")])
def test_artifacts_that_cannot_stream_are_refused_in_one_line(artifacts, kv, error):
    with pytest.raises(ValueError, match=error) as caught:
        LLM(artifacts[kv], streaming=STREAM)
    assert "\n" not in str(caught.value)


def test_an_artifact_whose_manifest_names_no_rotary_tables_cannot_stream(artifacts,
                                                                         tmp_path):
    """One compiled before the tables were recorded beside the reason (none to turn kept
    keys with): refused in one line."""
    old = tmp_path / "old"
    shutil.copytree(artifacts["float-activations"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["graphs"]["target"]["native"]["rope"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="streaming needs the target's rotary tables") as caught:
        LLM(old, streaming=STREAM)
    assert "\n" not in str(caught.value)


def test_a_recipe_streams_unless_the_caller_turns_it_off(artifacts):
    on = LLM(artifacts["recipe"])
    assert on.engine.kv_cache_manager.streaming.config == STREAM
    generated = on.generate(random_prompt(20), greedy_params(100))[0].token_ids
    assert len(generated) == 100  # past max_context
    off = LLM(artifacts["recipe"], streaming=False)
    assert off.engine.kv_cache_manager.streaming is None


@pytest.mark.parametrize("streaming,error", [({"sinks": 8, "window": 8}, "below the window"),
                                             ({"window": 100}, "larger than max_context")])
def test_a_recipe_with_bad_streaming_fails_validation(tiny_checkpoints, streaming, error):
    with pytest.raises(ValueError, match=error):
        Recipe(model=str(tiny_checkpoints["llama"]), runtime={**RUNTIME, "streaming": streaming})
