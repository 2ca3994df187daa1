"""The source's tokenizer spec, its notes on ambiguous sources, and the compile-time
self-check that refuses a tokenizer the artifact would not reproduce."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_gguf import write_gguf
from tiny_tokenizers import FAMILY_TOKENIZERS, train_vocabulary
from transformers import AutoConfig, GenerationConfig

from llmopt.compiler.loader import generation_defaults, load_checkpoint
from llmopt.compiler.source_tokenizer import generation_notes, read_source_tokenizer
from llmopt.compiler.tokenizer_check import TokenizerMismatchError, check_tokenizer


def read(path: Path):
    """read_source_tokenizer on a GGUF file or an HF directory."""
    location, gguf_file = (path.parent, path.name) if path.suffix == ".gguf" else (path, None)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return read_source_tokenizer(str(location), gguf_file,
                                 AutoConfig.from_pretrained(location, **kwargs))


def check(source, **changes) -> dict:
    spec = source.spec.model_copy(update=changes)
    return check_tokenizer(source.hf, source.files["tokenizer.json"].decode(), spec)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_gemma_prepends_bos_as_transformers_does(form, family_checkpoints):
    source = read(family_checkpoints["gemma3_text"][form])
    spec = source.spec
    assert (spec.add_bos_token, spec.bos_token, spec.bos_token_id) == (True, "<bos>", 2)
    assert not spec.add_eos_token and spec.chat_template.startswith("{{ bos_token }}")
    assert spec.template_tokens == source.hf.special_tokens_map
    assert spec.kind == "BPE (byte fallback); normalizer Replace; pre-tokenizer Split"
    report = check(source)
    assert report["probe_tokens"] > 50 and report["chat_tokens"] > 20


def test_the_missing_bos_of_the_issue_is_caught(family_checkpoints):
    """A Gemma 3 GGUF artifact without BOS: what issue 11 found by hand."""
    source = read(family_checkpoints["gemma3_text"]["gguf"])
    with pytest.raises(TokenizerMismatchError, match=r"probe text: transformers gives \d+ "
                       r"tokens, the artifact \d+; first difference at token 0: "
                       r"transformers 2 '<bos>'"):
        check(source, add_bos_token=False)


def test_a_different_template_or_vocabulary_is_caught(family_checkpoints):
    source = read(family_checkpoints["qwen3"]["hf"])
    with pytest.raises(TokenizerMismatchError, match="chat template: the texts differ"):
        check(source, chat_template=source.spec.chat_template.replace("assistant.", "bot."))
    other = read(family_checkpoints["gemma2"]["hf"]).files["tokenizer.json"].decode()
    with pytest.raises(TokenizerMismatchError, match="probe text"):
        check_tokenizer(source.hf, other, source.spec)


def test_specials_other_than_bos_and_eos_are_refused(family_checkpoints, tmp_path):
    directory = shutil.copytree(family_checkpoints["llama"]["hf"], tmp_path / "llama")
    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    processor = tokenizer_json["post_processor"]
    processor["single"] = [processor["single"][0], *processor["single"]]  # BOS twice
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    with pytest.raises(TokenizerMismatchError, match=r"adds \['<\|begin_of_text\|>', "
                       r"'<\|begin_of_text\|>'\] before"):
        read(directory)


@pytest.mark.parametrize(("arch", "adds"), [("mistral", True), ("qwen2", False)])
def test_gguf_without_add_bos_flag_is_noted(arch, adds, family_checkpoints, tmp_path):
    """llama.cpp and transformers default differently by vocabulary kind: say which."""
    family = dataclasses.replace(FAMILY_TOKENIZERS[arch], add_bos=None)
    path = write_gguf(family_checkpoints[arch]["hf"], family, train_vocabulary(family),
                      tmp_path / "noflag.gguf")
    source = read(path)
    assert source.spec.add_bos_token is adds
    assert any("does not say whether to add BOS" in note and
               ("prepends" if adds else "adds none") in note for note in source.spec.notes)
    check(source)


def test_gguf_end_of_turn_token_is_noted(family_checkpoints):
    """transformers stops Gemma GGUFs at <eos> only; the compile says <end_of_turn> exists."""
    path = family_checkpoints["gemma2"]["gguf"]
    ir = load_checkpoint(str(path))
    assert ir.arch.eos_token_ids == (1,)
    assert [n for n in ir.tokenizer_spec.notes if "'<end_of_turn>' (6)" in n and
            "does not stop there" in n]
    assert not load_checkpoint(str(family_checkpoints["gemma2"]["hf"])).tokenizer_spec.notes


def test_unsupported_generation_settings_are_noted(family_checkpoints):
    source = read(family_checkpoints["qwen2"]["hf"])
    notes = generation_notes(source.hf, "x", None, GenerationConfig(num_beams=4))
    assert notes == ["generation config sets num_beams=4, which the runtime does not "
                     "implement; ignored"]


def test_gguf_named_mistral_loads_though_transformers_alone_cannot(family_checkpoints,
                                                                   tmp_path):
    """transformers reads a llama-architecture GGUF named exactly "mistral" as Mistral and
    then cannot load its weights; read a tensor at a time, it loads with the weights of the
    same file under another name."""
    family = FAMILY_TOKENIZERS["mistral"]
    path = write_gguf(family_checkpoints["mistral"]["hf"], family, train_vocabulary(family),
                      tmp_path / "named.gguf", name="mistral")
    named, usual = load_checkpoint(str(path)), load_checkpoint(
        str(family_checkpoints["mistral"]["gguf"]))
    assert named.annotations["hf_config"]["model_type"] == "mistral"
    assert all(torch.equal(named.weights[n], usual.weights[n]) for n in usual.weights)


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, {"temperature": 0.0, "repetition_penalty": 1.0}),
    ({"repetition_penalty": 1.1}, {"temperature": 0.0, "repetition_penalty": 1.1}),
    ({"do_sample": True}, {"temperature": 1.0, "top_k": 50, "top_p": 1.0,
                           "repetition_penalty": 1.0}),
    ({"do_sample": True, "temperature": 0.6, "top_k": 0, "min_p": 0.05, "max_new_tokens": 9},
     {"temperature": 0.6, "top_k": 0, "top_p": 1.0, "min_p": 0.05, "repetition_penalty": 1.0,
      "max_new_tokens": 9}),
])
def test_generation_defaults_are_what_generate_uses(settings, expected):
    assert generation_defaults(GenerationConfig(**settings)) == expected
