"""Checkpoint → recipe → artifact → runtime, against transformers, for every architecture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_checkpoints import TINY_CONFIGS
from transformers import AutoModelForCausalLM

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NEW_TOKENS = 40
BLOCKS_LAYOUT = ["llama", "mistral", "gemma3_text"]


def compile_tiny(checkpoint: Path, out: Path, **target: str) -> Path:
    recipe = Recipe(model=str(checkpoint), target=target,
                    runtime={"block_size": 4, "max_context": 256, "max_num_seqs": 16})
    compile_recipe(recipe, out, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    built = {arch: compile_tiny(path, root / arch) for arch, path in tiny_checkpoints.items()}
    for arch in BLOCKS_LAYOUT:  # the gathered fallback, where lanes are the default
        built[f"{arch}/blocks"] = compile_tiny(tiny_checkpoints[arch], root / f"{arch}-blocks",
                                               kv_layout="blocks")
    return built


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(5, 30))).tolist() for _ in range(count)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy generate, running past EOS like `ignore_eos`."""
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                         attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


ALL_LAYOUTS = [*TINY_CONFIGS, *(f"{arch}/blocks" for arch in BLOCKS_LAYOUT)]


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_greedy_output_equals_transformers(name, artifacts, tiny_checkpoints):
    arch = name.removesuffix("/blocks")
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.float32)
    llm = LLM(artifacts[name])
    cases = prompts(seed=1, count=3)
    outputs = llm.generate(cases, GREEDY)
    for prompt, output in zip(cases, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf, prompt)


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_logits_match_transformers(name, artifacts, tiny_checkpoints):
    arch = name.removesuffix("/blocks")
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.float32)
    tokens = prompts(seed=2, count=1)[0] * 4  # longer than Mistral/Gemma sliding windows
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1)
    expected = expected[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    got = LLM(artifacts[name], max_num_batched_tokens=16).score(tokens)  # chunked prefill
    np.testing.assert_allclose(got, expected, atol=1e-4)


def shared_prefix_requests() -> list[list[int]]:
    """16 prompts of different lengths; half share a 24-token prefix (six full blocks)."""
    prefix = prompts(seed=3, count=1)[0][:5] * 5
    tails = prompts(seed=4, count=16)
    return [(prefix[:24] + t if i % 2 else t) for i, t in enumerate(tails)]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_batching_is_invisible(arch, artifacts):
    requests = shared_prefix_requests()
    alone = [LLM(artifacts[arch]).generate([r], GREEDY)[0].token_ids for r in requests[:4]]
    llm = LLM(artifacts[arch])
    together = [o.token_ids for o in llm.generate(requests, GREEDY)]
    assert together[:4] == alone
    one_at_a_time = [llm.generate([r], GREEDY)[0].token_ids for r in requests]
    assert together == one_at_a_time


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_changes_no_output(arch, artifacts):
    requests = shared_prefix_requests()
    expected = [o.token_ids for o in LLM(artifacts[arch]).generate(requests, GREEDY)]
    # At most 24 + 29 + 40 = 93 tokens a sequence: 24 blocks of 4; 60 blocks hold two.
    small = LLM(artifacts[f"{arch}/blocks"], num_blocks=60, max_context=96)
    outputs = small.generate(requests, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_lanes_wait_for_a_free_lane_instead(arch, artifacts):
    """The same small pool holds two lanes of 24 blocks: sequences queue for a lane, the
    shared prefix is copied between lanes, and nothing changes in the outputs."""
    requests = shared_prefix_requests()
    expected = [o.token_ids for o in LLM(artifacts[f"{arch}/blocks"]).generate(requests, GREEDY)]
    small = LLM(artifacts[arch], num_blocks=60, max_context=96)
    outputs = small.generate(requests, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) == 0
    assert sum(o.metrics.num_cached_tokens for o in outputs) > 0


def test_prefix_cache_shares_blocks(artifacts):
    llm = LLM(artifacts["llama"])
    prefix = prompts(seed=5, count=1)[0][:5] * 4  # 20 tokens: five full blocks of 4
    first = llm.generate([prefix + [7, 8, 9]], GREEDY)[0]
    second = llm.generate([prefix + [10, 11]], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens == 20
    uncached = LLM(artifacts["llama"], enable_prefix_caching=False)
    assert uncached.generate([prefix + [10, 11]], GREEDY)[0].token_ids == second.token_ids
