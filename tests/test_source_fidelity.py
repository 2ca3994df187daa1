"""Source fidelity: for every family, in HF-directory and GGUF form, the artifact sees and
generates exactly what transformers does on the same file — prompt ids (BOS included),
chat-templated ids, 32 greedy tokens and their text, EOS ids and sampling defaults."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_checkpoints import TINY_CONFIGS
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmopt.cli import main
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime import LLM

PROMPT = "It is named after the engineer who built the first bridge."
CHAT = "Why is the sky blue?"
NEW_TOKENS = 32
SOURCES = [(arch, form) for arch in TINY_CONFIGS for form in ("hf", "gguf")]
# Every family's real tokenizer adds BOS except Qwen's (and SmolLM2's, tested in test_smollm2).
ADDS_BOS = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False, "gemma2": True,
            "gemma3_text": True}


def source_of(paths: dict[str, Path], form: str) -> tuple[Path, dict[str, str]]:
    """(what from_pretrained takes, its kwargs) for one form of a family checkpoint."""
    if form == "gguf":
        return paths["gguf"].parent, {"gguf_file": paths["gguf"].name}
    return paths["hf"], {}


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Tiny models gain nothing from threads; on a busy machine their spinning costs 20x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf(family_checkpoints):
    """(arch, form) -> transformers' (tokenizer, model) on that file, loaded once."""
    cache = {}

    def load(arch: str, form: str):
        if (arch, form) not in cache:
            location, kwargs = source_of(family_checkpoints[arch], form)
            cache[arch, form] = (
                AutoTokenizer.from_pretrained(location, **kwargs),
                AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs))
        return cache[arch, form]

    return load


@pytest.fixture(scope="module")
def artifacts(family_checkpoints, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("fidelity")
    out = {}
    for arch, form in SOURCES:
        recipe = Recipe(model=str(family_checkpoints[arch][form]),
                        runtime={"block_size": 4, "max_context": 128, "max_num_seqs": 4})
        out[arch, form] = root / f"{arch}-{form}"
        compile_recipe(recipe, out[arch, form], log=lambda _: None)
    return out


@pytest.mark.parametrize(("arch", "form"), SOURCES)
def test_artifact_sees_and_generates_what_transformers_does(arch, form, artifacts, hf):
    tokenizer, model = hf(arch, form)
    llm = LLM(artifacts[arch, form], num_threads=1)
    # Greedy, but otherwise the checkpoint's defaults: transformers' greedy generate still
    # applies the generation config's repetition penalty (Qwen2's is 1.05).
    greedy = replace(llm.default_params, max_tokens=NEW_TOKENS, temperature=0.0,
                     ignore_eos=True)
    plain, chat = llm.generate([PROMPT], greedy)[0], llm.generate([CHAT], greedy, chat=True)[0]

    expected_ids = tokenizer(PROMPT)["input_ids"]
    assert plain.prompt_token_ids == expected_ids
    assert (expected_ids[0] == tokenizer.bos_token_id) == ADDS_BOS[arch]
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": CHAT}],
                                             add_generation_prompt=True)["input_ids"]
    assert chat.prompt_token_ids == chat_ids
    for output, ids in ((plain, expected_ids), (chat, chat_ids)):
        expected = hf_greedy(model, ids)
        assert output.token_ids == expected
        assert output.text == tokenizer.decode(expected, skip_special_tokens=True)


def hf_greedy(model, ids: list[int]) -> list[int]:
    """transformers' greedy continuation, past EOS like `ignore_eos`."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=NEW_TOKENS, eos_token_id=None, min_new_tokens=NEW_TOKENS)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize(("arch", "form"), SOURCES)
def test_eos_and_sampling_defaults_are_transformers(arch, form, artifacts, hf):
    """The runtime stops at transformers' EOS ids and samples with its effective defaults
    (the checkpoint's generation config, transformers' global defaults where it is silent)."""
    generation = hf(arch, form)[1].generation_config
    eos = generation.eos_token_id
    llm = LLM(artifacts[arch, form], num_threads=1)
    assert sorted(llm.manifest.model.eos_token_ids) == sorted([eos] if isinstance(eos, int)
                                                              else eos)
    params = llm.default_params
    if not generation.do_sample:
        assert params.greedy
        return
    assert params.temperature == (generation.temperature or 1.0)
    assert params.top_k == (generation.top_k or 50)
    assert params.top_p == (generation.top_p or 1.0)
    assert params.repetition_penalty == (generation.repetition_penalty or 1.0)


def test_cli_reports_what_the_model_saw(artifacts, hf):
    """`generate --json` gives the prompt's token ids; `inspect` says BOS is added."""
    tokenizer = hf("gemma3_text", "gguf")[0]
    artifact = artifacts["gemma3_text", "gguf"]
    result = CliRunner().invoke(main, ["generate", str(artifact), PROMPT, "--max-tokens", "2",
                                       "--threads", "1", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["prompt_token_ids"] == tokenizer(PROMPT)["input_ids"]
    result = CliRunner().invoke(main, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.stderr
    assert "adds BOS '<bos>' (2)" in result.stdout and "chat template" in result.stdout
    assert "matches transformers" in result.stdout and "<end_of_turn>" in result.stdout
    facts = json.loads(CliRunner().invoke(main, ["inspect", str(artifact), "--json"]).stdout)
    assert facts["tokenizer"]["add_bos_token"] and facts["tokenizer"]["chat_template"]


def test_unreproducible_tokenizer_is_a_one_line_error(family_checkpoints, tmp_path):
    """Bad input: a tokenizer that adds two BOS tokens is refused naming them; nothing is
    written."""
    source = shutil.copytree(family_checkpoints["llama"]["hf"], tmp_path / "llama")
    tokenizer_json = json.loads((source / "tokenizer.json").read_text())
    single = tokenizer_json["post_processor"]["single"]
    tokenizer_json["post_processor"]["single"] = [single[0], *single]
    (source / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {source}\n")
    result = CliRunner().invoke(main, ["compile", str(recipe), "-o", str(tmp_path / "out")])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: the source tokenizer adds ['<|begin_of_text|>', "
                               "'<|begin_of_text|>'] before")
    assert not (tmp_path / "out").exists()


def test_cli_samples_with_the_checkpoints_defaults(artifacts):
    """Qwen2's generation config samples (temperature 0.7, top-k 20, top-p 0.8, repetition
    penalty 1.05): `llmopt generate` without sampling options does exactly that."""
    artifact = artifacts["qwen2", "hf"]
    llm = LLM(artifact, num_threads=1)
    seeded = replace(llm.default_params, max_tokens=12, seed=3)
    assert (seeded.temperature, seeded.top_k, seeded.top_p) == (0.7, 20, 0.8)
    expected = llm.generate([PROMPT], seeded)[0].token_ids
    greedy = llm.generate([PROMPT], replace(seeded, temperature=0.0))[0].token_ids
    result = CliRunner().invoke(main, ["generate", str(artifact), PROMPT, "--max-tokens", "12",
                                       "--seed", "3", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == expected != greedy
