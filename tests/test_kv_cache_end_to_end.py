"""Quantized KV pools end to end: recipe → artifact → runtime on tiny checkpoints.

Batching is invisible with a quantized pool: each token's entries are quantized on their
own (per token, or with static scales), so a request's greedy output is the same alone,
in a batch of 16 sharing prefixes, under preemption, and with speculation on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_end_to_end import GREEDY, shared_prefix_requests

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM
from llmopt.tools.inspect import describe, format_description

STATIC_INT8 = {"dtype": "int8", "key_scales": "channel", "value_scales": "channel"}
STATIC_INT4 = {**STATIC_INT8, "dtype": "int4"}
MIXED_INT4 = {**STATIC_INT4, "skip_dtype": "int8", "auto_skip": 1}
OTHER_ARCHS = ("mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
QUICK_DRAFT = {"prompts": 2, "new_tokens": 12, "batch_sizes": [1, 2], "cost_repeats": 1}
ARTIFACTS = {
    # name -> (architecture, kv_cache options, draft options)
    "llama-int8": ("llama", {"dtype": "int8"},
                   {"kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3}),
    "gemma3-int4": ("gemma3_text", {"dtype": "int4", "group_size": 8, "rotate": True},
                    {"kind": "ngram", "gamma": 3}),
    "qwen2-fp8": ("qwen2", {"dtype": "fp8_e4m3", "key_scales": "channel"}, None),
    "qwen2-bf16": ("qwen2", {"dtype": "bfloat16"}, {"kind": "ngram", "gamma": 3}),
    # float16 lanes: the node runs on float16 queries, keys and values (every layout
    # rounds the queries and the output so); gemma2: sliding windows and softcaps.
    "llama-fp16": ("llama", {"dtype": "float16"}, {"kind": "ngram", "gamma": 3}),
    "llama-fp16/blocks": ("llama", {"dtype": "float16"}, None),
    "gemma2-fp16": ("gemma2", {"dtype": "float16"},
                    {"kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3}),
    "gemma2-fp16/blocks": ("gemma2", {"dtype": "float16"}, None),
    # Static channel scales on both sides: ONNX Runtime's GroupQueryAttention stores and
    # reads the int8 codes in place (lanes); the same recipe over blocks beside it.
    "llama-int8-static": ("llama", STATIC_INT8, {"kind": "ngram", "gamma": 3}),
    "llama-int8-static/blocks": ("llama", STATIC_INT8, None),
    # Rotated keys on lanes: RoPE and the Hadamard rotation run before the node.
    "llama-int8-static-rot": ("llama", {**STATIC_INT8, "rotate": True}, None),
    "llama-int8-static-rot/blocks": ("llama", {**STATIC_INT8, "rotate": True}, None),
    "llama-int4-static-rot": ("llama", {**STATIC_INT4, "rotate": True},
                              {"kind": "ngram", "gamma": 3}),
    "llama-int4-static-rot/blocks": ("llama", {**STATIC_INT4, "rotate": True}, None),
    # int4 with the most sensitive layer kept in int8: lanes of both widths in one model.
    "llama-int4-mixed": ("llama", MIXED_INT4, {"kind": "ngram", "gamma": 3}),
    "llama-int4-mixed/blocks": ("llama", MIXED_INT4, None),
    # Attention sinks: the first positions unrounded in the runtime's sink store (blocks).
    "llama-int4-sinks": ("llama", {**STATIC_INT4, "sink_tokens": 2},
                         {"kind": "ngram", "gamma": 3}),
    "qwen3-int8-sinks": ("qwen3", {"dtype": "int8", "sink_tokens": 3},
                         {"kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3}),
    # Keys scaled per channel per block (KIVI); the filling block waits in a tail store.
    "llama-int4-kblock": ("llama", {"dtype": "int4", "key_scales": "block"},
                          {"kind": "ngram", "gamma": 3}),
    "gemma2-int4-kblock": ("gemma2", {"dtype": "int4", "key_scales": "block"}, None),
    "qwen3-int8-kblock": ("qwen3", {"dtype": "int8", "key_scales": "block",
                                    "value_scales": "channel"},
                          {"kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3}),
    # ... and on every other architecture (biases, qk-norm, sliding windows, softcaps)
    **{f"{arch}-int4-mixed{twin}": (arch, MIXED_INT4, None)
       for arch in OTHER_ARCHS for twin in ("", "/blocks")},
}
LANES_TWINS = ["llama-fp16", "gemma2-fp16", "llama-int8-static", "llama-int8-static-rot",
               "llama-int4-static-rot", *(f"{arch}-int4-mixed" for arch in ("llama", *OTHER_ARCHS))]


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for name, (arch, kv, draft) in ARTIFACTS.items():
        passes = [{"kv_cache": {**kv, "calibration_samples": 2}}]
        if draft:
            passes.append({"draft": {**QUICK_DRAFT, **draft}})
        layout = "blocks" if name.endswith("/blocks") else "auto"
        recipe = Recipe(model=str(tiny_checkpoints[arch]), passes=passes,
                        calibration={"text": str(word_text), "samples": 4, "seq_len": 64},
                        target={"kv_layout": layout},
                        runtime={"block_size": 4, "max_context": 128, "max_num_seqs": 16})
        out[name] = root / name.replace("/", "-")
        compile_recipe(recipe, out[name], log=lambda _: None)
    return out


@pytest.mark.parametrize("name", list(ARTIFACTS))
def test_batching_and_preemption_are_invisible(name, artifacts):
    requests = shared_prefix_requests()
    llm = LLM(artifacts[name], speculative=False)
    alone = [llm.generate([r], GREEDY)[0].token_ids for r in requests]
    together = llm.generate(requests, GREEDY)
    assert [o.token_ids for o in together] == alone
    assert sum(o.metrics.num_cached_tokens for o in together) > 0  # prefixes were shared
    small = LLM(artifacts[name], num_blocks=60, max_context=96, speculative=False)
    preempted = small.generate(requests, GREEDY)
    assert [o.token_ids for o in preempted] == alone
    lanes = small.manifest.kv_cache.layout == "lanes"  # lanes wait for a lane instead
    assert (sum(o.metrics.num_preemptions for o in preempted) > 0) != lanes


@pytest.mark.parametrize("name", LANES_TWINS)
def test_lanes_store_what_the_gathered_graph_stores(name, artifacts):
    """The same codes in both pools (layer 0's keys: the same inputs; an occasional
    rounding tie differs by one code). Both graphs attend to the stored values, so the
    scores agree up to such a tie (measured: 4e-3 at most, 1e-5 without one)."""
    lanes, blocks = (LLM(artifacts[n], speculative=False) for n in (name, f"{name}/blocks"))
    assert (lanes.manifest.kv_cache.layout, blocks.manifest.kv_cache.layout) == ("lanes",
                                                                               "blocks")
    pools = lanes.engine.executor.pools
    for i, layer in enumerate(lanes.manifest.kv_cache.layers):  # each in its own dtype
        assert pools[f"past.{i}.key"].dtype == np.dtype(layer.tensors[0].dtype)
    tokens = (shared_prefix_requests()[1] * 3)[:120]
    np.testing.assert_allclose(lanes.score(tokens), blocks.score(tokens), atol=5e-3)
    in_lane = lanes.engine.executor.pools["past.0.key"][0]  # lane 0: [kv_heads, pos, dim]
    in_lane = in_lane.transpose(1, 0, 2).reshape(in_lane.shape[1], -1)[: len(tokens)]
    in_blocks = blocks.engine.executor.pools["past.0.key"].reshape(-1, in_lane.shape[1])
    in_blocks = in_blocks[4 : 4 + len(tokens)]  # blocks 1.. of block size 4, in order
    if in_lane.dtype == np.float16:  # equal but where a rounding flipped upstream
        steps = np.abs(in_lane - in_blocks) / np.spacing(np.abs(in_blocks).max(-1, keepdims=True))
        assert steps.max() <= 1 and (steps == 0).mean() > 0.9
        return
    if in_lane.dtype == np.uint8:  # int4, two codes a byte in both layouts: compare nibbles
        in_lane, in_blocks = (np.stack([a & 15, a >> 4], -1) for a in (in_lane, in_blocks))
    differs = np.abs(in_lane.astype(int) - in_blocks.astype(int))
    assert differs.max() <= 1 and (differs == 0).mean() > 0.9


@pytest.mark.parametrize("name", ["llama-int8", "gemma3-int4", "llama-int8-static",
                                  "llama-int4-static-rot", "llama-int4-mixed",
                                  "llama-int4-sinks", "qwen3-int8-sinks",
                                  "llama-int4-kblock", "qwen3-int8-kblock"])
def test_speculation_changes_no_greedy_output(name, artifacts):
    requests = shared_prefix_requests()
    expected = [o.token_ids for o in LLM(artifacts[name], speculative=False).generate(
        requests, GREEDY)]
    for options in ({}, {"num_blocks": 60, "max_context": 96}):
        llm = LLM(artifacts[name], speculative_max_batch_size=16, adaptive_speculation=False,
                  **options)
        outputs = llm.generate(requests, GREEDY)
        assert [o.token_ids for o in outputs] == expected, options
        assert sum(o.metrics.speculation.num_spec_steps for o in outputs) > 0


def test_pools_are_allocated_from_the_manifest(artifacts):
    llm = LLM(artifacts["gemma3-int4"], speculative=False)
    info = describe(artifacts["gemma3-int4"], pool_mib=1)
    pools = llm.engine.executor.pools
    assert {p.dtype for p in pools.values()} == {np.dtype("uint8"), np.dtype("float16")}
    per_token = sum(p[0, 0].nbytes for p in pools.values())
    assert per_token == info["kv_bytes_per_token"]
    report = next(p for p in info["passes"] if p["name"] == "kv_cache")
    assert report["bytes_per_token"]["after"] == per_token
    # float32: 4 bytes a channel; int4 in groups of 8: half a byte + two float16 per 8.
    assert report["bytes_per_token"]["before"] == 4 * per_token
    assert info["kv_float32_bytes_per_token"] == 4 * per_token
    # 1 MiB of blocks of 4 tokens, less the null block, in whole blocks per sequence.
    blocks = 2**20 // (4 * per_token) - 1
    assert info["sequences_in_pool"]["128"] == blocks // 32
    text = format_description(info)
    assert "(4.00x smaller than float32)" in text
    assert "key uint8[" in text and "key_scale float16[" in text and "key_min float16[" in text


def test_mixed_int4_reads_int8_and_int4_lanes_in_place(artifacts):
    llm = LLM(artifacts["llama-int4-mixed"], speculative=False)
    assert llm.manifest.kv_cache.layout == "lanes"
    dtypes = [p.dtype for name, p in llm.engine.executor.pools.items() if name.endswith("key")]
    assert sorted(map(str, dtypes)) == ["int8", *["uint8"] * (len(dtypes) - 1)]
    info = describe(artifacts["llama-int4-mixed"], pool_mib=1)
    width = info["kv_float32_bytes_per_token"] // (8 * len(dtypes))  # channels per side
    assert info["kv_bytes_per_token"] == 2 * width * (1 + (len(dtypes) - 1) / 2)


def test_bfloat16_pools_hold_the_bit_patterns(artifacts):
    llm = LLM(artifacts["qwen2-bf16"], speculative=False)
    pools = llm.engine.executor.pools
    assert {p.dtype for p in pools.values()} == {np.dtype("uint16")}
    info = describe(artifacts["qwen2-bf16"], pool_mib=1)
    assert 2 * info["kv_bytes_per_token"] == info["kv_float32_bytes_per_token"]
    assert "key uint16[" in format_description(info)


def test_sinks_live_with_first_blocks(artifacts):
    """Sequences that share a cached first block share its sink row; the manifest and
    `inspect` say what the store costs a sequence."""
    llm = LLM(artifacts["llama-int4-sinks"], speculative=False)
    assert llm.manifest.kv_cache.layout == "blocks" and llm.manifest.kv_cache.sink_tokens == 2
    requests = shared_prefix_requests()
    for request in requests:  # one at a time: each shared prefix is a cache hit
        llm.generate([request], GREEDY)
    sinks = llm.engine.executor.pools.sinks
    first_blocks = {tuple(r[:4]) for r in requests}  # block size 4
    assert len(first_blocks) == 9 and len(sinks.row_of_block) == 9
    assert len(set(sinks.row_of_block.values())) == 9
    sinks.forget_block(next(iter(sinks.row_of_block)))  # the block is handed out again
    assert len(sinks.row_of_block) == 8 and len(sinks.free_rows) == 16 - 8
    info = describe(artifacts["llama-int4-sinks"], pool_mib=1)
    width = info["kv_float32_bytes_per_token"] // (2 * 4 * llm.manifest.model.num_layers)
    assert info["kv_sink_bytes_per_sequence"] == 2 * 2 * 4 * width * llm.manifest.model.num_layers
    assert "sink" in format_description(info)
    with pytest.raises(ValueError, match="block_size 1 is below the artifact's 2 sink tokens"):
        LLM(artifacts["llama-int4-sinks"], block_size=1)


def test_per_block_key_scales_are_described_and_fix_the_block_size(artifacts):
    llm = LLM(artifacts["llama-int4-kblock"], speculative=False)
    assert llm.manifest.kv_cache.block_size == 4
    pools = llm.engine.executor.pools
    assert pools["past.0.key_scale"].shape[1:] == pools["past.0.key_min"].shape[1:]
    assert pools["past.0.key_scale"].ndim == 2  # one entry per block
    info = describe(artifacts["llama-int4-kblock"], pool_mib=1)
    width = info["kv_float32_bytes_per_token"] // (8 * llm.manifest.model.num_layers)
    groups = llm.manifest.kv_cache.layers[0].tensors[-1].slot_shape[0]  # value groups
    # keys: half a byte + two float16 per channel per block of 4; values: per token
    per_layer = width / 2 + 2 * 2 * width / 4 + width / 2 + 2 * 2 * groups
    assert info["kv_bytes_per_token"] == per_layer * llm.manifest.model.num_layers
    assert info["kv_tail_bytes_per_sequence"] == 4 * 4 * width * llm.manifest.model.num_layers
    text = format_description(info)
    assert "a block" in text and "KV tails" in text
    with pytest.raises(ValueError, match="built for blocks of 4"):
        LLM(artifacts["llama-int4-kblock"], block_size=8)
