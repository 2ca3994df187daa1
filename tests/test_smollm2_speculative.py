"""Speculative decoding on the real model: SmolLM2-135M-Instruct with each derived draft
(prompt lookup, its own first layers, a tiny distilled model) gives exactly the greedy
output of plain decoding, alone, batched and under preemption. Slow: runs in CI.

The drafts are compiled with minimal distillation and measurement: this checks
exactness, not draft quality (benchmarks/bench_speculative.py measures speed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tiny_checkpoints import SHARED_DATA

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-instruct.yaml"
QUICK = {"prompts": 2, "new_tokens": 16, "batch_sizes": [1], "cost_repeats": 1}
DRAFTS = {
    "self+ngram": {"kind": "self", "layers": 2, "distill_steps": 0, "ngram": True,
                   "gamma": 3, "keep_unpaid_model": True},  # its drafts="model" runs need it
    "tiny": {"kind": "tiny", "num_layers": 1, "head_vocab": 4096, "distill_steps": 2,
             "gamma": 3},
}
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "What is the capital of France?",
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
    "Write a Python function that adds two numbers.",
    "List the days of the week.",
]


def compile_with_draft(out: Path, draft: dict) -> Path:
    raw = yaml.safe_load(RECIPE.read_text())
    gguf = raw["model"]
    raw.update(passes=[{"draft": {**QUICK, **draft}}],
               calibration={"text": str(SHARED_DATA / "wikitext2-valid.tokens.txt")},
               runtime={**raw["runtime"], "max_context": 256})
    raw["model"] = gguf
    compile_recipe(Recipe.model_validate(raw), out, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2-spec")
    return {name: compile_with_draft(root / name, draft) for name, draft in DRAFTS.items()}


@pytest.fixture(scope="module")
def chat_prompts(artifacts) -> list[list[int]]:
    llm = LLM(artifacts["tiny"], speculative=False)
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return (chats * 4)[:16]


@pytest.fixture(scope="module")
def plain_outputs(artifacts, chat_prompts) -> list[list[int]]:
    llm = LLM(artifacts["tiny"], speculative=False, max_context=256)
    return [o.token_ids for o in llm.generate(chat_prompts, GREEDY)]


@pytest.mark.parametrize("name, drafts", [("self+ngram", "ngram"), ("self+ngram", "model"),
                                          ("self+ngram", "all"), ("tiny", "model")])
def test_speculation_gives_the_plain_greedy_output(artifacts, chat_prompts, plain_outputs,
                                                   name, drafts):
    # γ drafts for every sequence at every batch size (the policy and the compiler's
    # batch-size limit would switch weak drafts off), so that speculation really runs.
    common = {"drafts": drafts, "adaptive_speculation": False,
              "speculative_max_batch_size": 16, "max_context": 256}
    alone = LLM(artifacts[name], **common)
    for prompt, expected in zip(chat_prompts[:2], plain_outputs[:2], strict=True):
        (out,) = alone.generate([prompt], GREEDY)
        assert out.token_ids == expected
        assert out.metrics.speculation.num_spec_steps > 0
    # 16 at once in a pool of 40 usable blocks (16 sequences need up to 16 x 6): the blocks
    # layout preempts; the lanes layout holds two lanes of 16 blocks, and sequences queue.
    crowded = LLM(artifacts[name], num_blocks=41, **common)
    outputs = crowded.generate(chat_prompts, GREEDY)
    assert [o.token_ids for o in outputs] == plain_outputs
    lanes = crowded.manifest.kv_cache.layout == "lanes"
    assert (sum(o.metrics.num_preemptions for o in outputs) > 0) != lanes
