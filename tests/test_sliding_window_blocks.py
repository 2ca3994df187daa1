"""Sliding-window layers with blocks of their own (blocks layout): freeing the blocks
behind the window changes no logit and no token, with prefix caching and speculation,
and bounds what those layers hold at a context many windows long."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.artifact import load_manifest

WINDOW = 12  # the tiny Gemma checkpoints' sliding window
ARCHS = ["gemma2", "gemma3_text"]


def compile_blocks(checkpoint: Path, out: Path, passes: list | None = None,
                   text: Path | None = None) -> Path:
    recipe = Recipe(model=str(checkpoint), target={"kv_layout": "blocks"},
                    passes=passes or [],
                    calibration={"text": str(text)} if text else {},
                    runtime={"block_size": 4, "max_context": 256, "max_num_seqs": 8})
    compile_recipe(recipe, out, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, word_text, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    built = {arch: compile_blocks(tiny_checkpoints[arch], root / arch) for arch in ARCHS}
    drafts = [{"draft": {"kind": "self", "layers": 1, "distill_steps": 5, "gamma": 3,
                         "ngram": True, "keep_unpaid_model": True, "prompts": 2,
                         "new_tokens": 12, "batch_sizes": [1, 2], "cost_repeats": 1}}]
    built["spec"] = compile_blocks(tiny_checkpoints["gemma3_text"], root / "spec", drafts,
                                   word_text)
    ngram = [{"draft": {"kind": "ngram", "gamma": 3, "prompts": 2, "new_tokens": 12,
                        "batch_sizes": [1, 2], "cost_repeats": 1}}]
    built["ngram"] = compile_blocks(tiny_checkpoints["gemma3_text"], root / "ngram", ngram,
                                    word_text)
    return built


def keep_everything(llm: LLM) -> LLM:
    """The same engine with nothing freed: a window no sequence outgrows."""
    llm.engine.kv_cache_manager.sliding.window = 10**9
    return llm


def long_tokens(seed: int, count: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, count).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_manifest_names_the_local_layers(arch, artifacts):
    layers = load_manifest(artifacts[arch]).kv_cache.layers
    assert [layer.local for layer in layers] == [layer.window == WINDOW for layer in layers]
    assert any(layer.local for layer in layers) and not all(layer.local for layer in layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_freeing_changes_no_logit(arch, artifacts):
    tokens = long_tokens(1, 200)  # more than sixteen windows
    freed = LLM(artifacts[arch], max_num_batched_tokens=16).score(tokens)
    kept = keep_everything(LLM(artifacts[arch], max_num_batched_tokens=16)).score(tokens)
    np.testing.assert_array_equal(freed, kept)


@pytest.mark.parametrize("arch", ARCHS)
def test_freeing_changes_no_greedy_token_and_bounds_local_blocks(arch, artifacts):
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    prompts = [long_tokens(2, 40), long_tokens(3, 25)]
    llm = LLM(artifacts[arch])
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    for prompt in prompts:
        engine.add_request(prompt, params)
    held, finished = [], {}
    while engine.has_unfinished_requests():
        held += [kv.blocks_held(r) for r in engine.scheduler.running]
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    expected = keep_everything(LLM(artifacts[arch])).generate(prompts, params)
    assert list(finished.values()) == [o.token_ids for o in expected]
    # A decode step's query sees its window: at most cdiv(WINDOW, 4) + 1 blocks.
    assert max(h["sliding"] for h in held[10:]) <= WINDOW // 4 + 1
    assert max(h["full"] for h in held) == 190 // 4
    assert kv.sliding.num_used_blocks == 0


def test_a_local_pool_sized_for_the_windows_runs_long_sequences(artifacts):
    """Two sequences of 16-token steps: the local group gets 2 * (cdiv(11 + 16, 4) + 1)
    blocks, against 2 * 64 for the full one, and nothing changes."""
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompts = [long_tokens(7, 60), long_tokens(8, 45), long_tokens(9, 70)]
    small = LLM(artifacts["gemma3_text"], max_num_seqs=2, max_num_batched_tokens=16)
    assert len(small.engine.kv_cache_manager.sliding.block_pool.blocks) == 17
    outputs = small.generate(prompts, params)
    expected = keep_everything(LLM(artifacts["gemma3_text"])).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_prefix_caching_stays_exact(artifacts):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prefix = long_tokens(4, 100)
    llm = LLM(artifacts["gemma3_text"])
    llm.generate([prefix + [5, 6]], params)
    second = llm.generate([prefix + [7, 8, 9]], params)[0]
    assert second.metrics.num_cached_tokens == 100
    uncached = LLM(artifacts["gemma3_text"], enable_prefix_caching=False)
    assert uncached.generate([prefix + [7, 8, 9]], params)[0].token_ids == second.token_ids


@pytest.mark.parametrize(("name", "drafts"), [("spec", "all"), ("spec", "model"),
                                              ("ngram", "all")])
def test_speculation_stays_exact(name, drafts, artifacts):
    """A self draft (the target's first layer, a sliding one) trails the target over the
    same local tables; n-gram drafts roll back by length."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    base = long_tokens(5, 15)
    prompts = [base * 4, long_tokens(6, 30), base * 3]
    llm = LLM(artifacts[name], drafts=drafts, adaptive_speculation=False,
              speculative_max_batch_size=8)  # speculate although it does not pay here
    assert llm.engine.kv_cache_manager.sliding_trails == (name == "spec")
    outputs = llm.generate(prompts, params)
    plain = LLM(artifacts[name], speculative=False).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert sum(o.metrics.speculation.num_accepted_tokens for o in outputs) > 0


def test_inspect_shows_what_a_long_sequence_holds_per_layer_group(artifacts):
    from llmopt.tools.inspect import describe, format_description

    info = describe(artifacts["gemma3_text"])
    layer_bytes = 2 * 2 * 16 * 4  # keys and values, 2 KV heads of 16, float32
    held = info["kv_bytes_per_sequence"]["32768"]
    assert held == {"full": layer_bytes * 32768,  # layer 1
                    "sliding": 2 * layer_bytes * 4 * (WINDOW // 4 + 1)}  # layers 0 and 2
    assert "12-token window" in format_description(info)


def test_bench_shows_what_a_sequence_holds(artifacts):
    from click.testing import CliRunner

    from llmopt.cli import main

    result = CliRunner().invoke(main, ["bench", str(artifacts["gemma3_text"]), "--batch", "1",
                                       "--prompt-len", "200", "--gen-len", "4"])
    assert result.exit_code == 0, result.output
    # 204 tokens: 51 blocks of 4 in the full layer (256 bytes a token), 4 in each local one
    assert ("KV a sequence holds at 204 tokens: 0.05 MiB full-attention layers + 0.01 MiB "
            "sliding-window layers (window 12; blocks behind it freed)") in result.output
