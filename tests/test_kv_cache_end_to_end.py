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
from llmopt.runtime.inspect import describe, format_description

QUICK_DRAFT = {"prompts": 2, "new_tokens": 12, "batch_sizes": [1, 2], "cost_repeats": 1}
ARTIFACTS = {
    # name -> (architecture, kv_cache options, draft options)
    "llama-int8": ("llama", {"dtype": "int8"},
                   {"kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3}),
    "gemma3-int4": ("gemma3_text", {"dtype": "int4", "group_size": 8, "rotate": True},
                    {"kind": "ngram", "gamma": 3}),
    "qwen2-fp8": ("qwen2", {"dtype": "fp8_e4m3", "key_scales": "channel"}, None),
}


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv")
    out = {}
    for name, (arch, kv, draft) in ARTIFACTS.items():
        passes = [{"kv_cache": {**kv, "calibration_samples": 2}}]
        if draft:
            passes.append({"draft": {**QUICK_DRAFT, **draft}})
        recipe = Recipe(model=str(tiny_checkpoints[arch]), passes=passes,
                        calibration={"text": str(word_text), "samples": 4, "seq_len": 64},
                        runtime={"block_size": 4, "max_context": 128, "max_num_seqs": 16})
        compile_recipe(recipe, root / name, log=lambda _: None)
        out[name] = root / name
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
    assert sum(o.metrics.num_preemptions for o in preempted) > 0


@pytest.mark.parametrize("name", ["llama-int8", "gemma3-int4"])
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
