"""The draft pass end to end: its config, its place in the recipe, and the artifact's
draft graph + manifest.speculative."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from draft_helpers import (
    QUICK,
    SUBSET_TOKENS,
    TARGET_TOKENS,
    compile_with_draft,
    draft_logits,
    truncated_logits,
)

from llmopt.compiler.pipeline import check_pass_order, compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.passes import draft
from llmopt.passes.draft import model as dm
from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.native import unavailable_reason

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_config_checks_keys_against_the_kind():
    with pytest.raises(ValueError, match="layers does not apply to kind 'tiny'"):
        draft.make_config(kind="tiny", layers=2)
    with pytest.raises(ValueError, match="needs `model: PATH`"):
        draft.make_config(kind="model")
    with pytest.raises(ValueError, match="head_vocab does not apply to kind 'ngram'"):
        draft.make_config(kind="ngram", head_vocab=10)
    with pytest.raises(ValueError, match="gamma"):
        draft.make_config(kind="self", gamma=9)
    with pytest.raises(ValueError, match="unknown draft pass"):
        draft.make_config(kind="self", passes=[{"draft": {}}])
    assert draft.make_config(kind="self", ngram=True).ngram_options().max_n == 4
    assert draft.make_config(kind="ngram").ngram_options().min_n == 1


def test_draft_must_be_the_last_pass(target_dir):
    recipe = Recipe(model=str(target_dir), passes=[{"draft": {"kind": "ngram"}}, {"rtn": {}}])
    with pytest.raises(ValueError, match="must be the last pass"):
        check_pass_order(recipe)


def test_self_draft_artifact(target_dir, target, word_text, tmp_path):
    out = compile_with_draft(target_dir, word_text, tmp_path / "a", kind="self", layers=2,
                             gamma=3, passes=[{"rtn": {"bits": 8, "group_size": 32}}])
    manifest = load_manifest(out)
    spec = manifest.speculative
    assert set(manifest.graphs) == {"target", "draft"} and spec.gamma == 3
    assert spec.model.kind == "self" and spec.model.token_map is None and spec.ngram is None
    assert len(spec.model.kv_cache.layers) == 2 and spec.model.vocab_size == 256
    assert len(spec.acceptance) == 8 and spec.cost_ratio > 0
    assert len(spec.verify_cost) == 9 and spec.verify_cost[0] == 1.0
    assert len(spec.measured["predicted_speedup"]) == 2
    report = manifest.passes[0]
    assert report["name"] == "draft" and report["passes"][0]["name"] == "rtn"
    assert manifest.ir["draft"]["arch"]["layers"] and "draft.onnx" in manifest.files
    # The draft graph computes the 8-bit truncated target (its own rtn pass).
    from llmopt.passes import rtn

    quantized = rtn.run(dm.truncated(target, 2), rtn.Config(bits=8, group_size=32), None).ir
    tokens = list(range(3, 33))
    expected = truncated_logits(quantized, torch.tensor([tokens]), 2)[0].numpy()
    np.testing.assert_allclose(draft_logits(out, tokens), expected, atol=1e-4)


def test_a_head_trimmed_draft_takes_its_own_lossy_pass(target_dir, word_text, tmp_path):
    """A draft whose LM head keeps a token subset (`head_vocab`) has logits rows that are
    not token ids: its own rtn pass reports KL and top-1 agreement and no perplexity
    (it used to index the text's token ids into its rows and fail)."""
    out = compile_with_draft(target_dir, word_text, tmp_path / "trim", kind="self", layers=2,
                             head_vocab=64, gamma=2,
                             passes=[{"rtn": {"bits": 4, "group_size": 32}}])
    manifest = load_manifest(out)
    assert manifest.speculative.model.vocab_size < 256  # 64 rows and the special tokens
    quality = manifest.passes[0]["passes"][0]["quality"]
    assert quality["kl"] > 0 and 0 < quality["top1_agreement"] <= 1
    assert quality["ppl_before"] is None and quality["perplexity_on"].startswith("none")


def test_subset_model_draft_artifact_with_ngram(target_dir, subset_dir, word_text, tmp_path):
    out = compile_with_draft(target_dir, word_text, tmp_path / "b", kind="model",
                             model=str(subset_dir), ngram={"max_n": 3},
                             keep_unpaid_model=True)
    manifest = load_manifest(out)
    spec = manifest.speculative
    assert spec.ngram.max_n == 3 and spec.model.kind == "model"
    assert spec.model.vocab_size == len(SUBSET_TOKENS)
    token_map = np.load(out / spec.model.token_map)
    assert spec.model.token_map in manifest.files
    assert token_map.tolist() == [TARGET_TOKENS.index(t) for t in SUBSET_TOKENS]
    logits = draft_logits(out, list(range(3, 20)))
    assert logits.shape == (17, len(SUBSET_TOKENS))
    assert spec.measured["model_only"]["gamma"] >= 1 and "ngram_only" in spec.measured
    assert "ngram_match_rate" in spec.measured and manifest.passes[0]["vocabulary"] == (
        "mapped subset")


def test_a_model_draft_that_costs_more_than_it_returns_is_dropped(target_dir, word_text,
                                                                 tmp_path, monkeypatch):
    """Where n-gram drafts alone were predicted faster than with the model as fallback,
    the artifact keeps no model: γ, batch limit and acceptance are the n-gram's, the
    model's measurement stays on record; keep_unpaid_model keeps it."""
    from llmopt.passes.draft import choice

    monkeypatch.setattr(choice, "ngram_alone_pays_more", lambda spec: True)
    out = compile_with_draft(target_dir, word_text, tmp_path / "d", kind="self", layers=2,
                             ngram=True)
    manifest = load_manifest(out)
    spec, alone = manifest.speculative, manifest.speculative.measured["ngram_only"]
    assert set(manifest.graphs) == {"target"} and spec.model is None and spec.ngram
    assert (spec.gamma, spec.max_batch_size, spec.acceptance, spec.cost_ratio) == (
        alone["gamma"], alone["max_batch_size"], alone["acceptance"], 0.0)
    assert spec.predicted_speedup == alone["predicted_speedup"][0]
    assert "keep_unpaid_model: true keeps it" in manifest.passes[0]["model_dropped"]
    kept = load_manifest(compile_with_draft(target_dir, word_text, tmp_path / "e", kind="self",
                                            layers=2, ngram=True, keep_unpaid_model=True))
    assert kept.speculative.model is not None and "model_dropped" not in kept.passes[0]


def test_the_model_is_dropped_only_where_ngram_alone_was_predicted_faster():
    from llmopt.passes.draft.choice import ngram_alone_pays_more

    def spec(alone: float, both: float) -> dict:
        return {"predicted_speedup": both,
                "measured": {"ngram_only": {"predicted_speedup": [alone, 1.0]}}}

    assert ngram_alone_pays_more(spec(1.3, 1.1))
    assert not ngram_alone_pays_more(spec(1.1, 1.3))
    assert not ngram_alone_pays_more({"predicted_speedup": 1.0, "measured": {}})


def test_ngram_only_artifact(target_dir, word_text, tmp_path):
    manifest = load_manifest(compile_with_draft(target_dir, word_text, tmp_path / "c",
                                                kind="ngram"))
    spec = manifest.speculative
    assert set(manifest.graphs) == {"target"} and spec.model is None
    assert spec.ngram.min_n == 1 and 1 <= spec.gamma <= 8 and spec.cost_ratio == 0.0
    # float32 projections: the native step cannot run them, ONNX Runtime's steps were timed
    assert spec.measured["kernels"] == "onnxruntime"


def test_step_costs_are_timed_on_the_kernels_the_runtime_picks(target_dir, word_text,
                                                                tmp_path):
    """int4 weights on int8 activations: where the native step runs here, the draft pass
    times its steps (their cost differs in shape from ONNX Runtime's), as `kernels: auto`
    will run the artifact."""
    recipe = Recipe(model=str(target_dir),
                    passes=[{"rtn": {"bits": 4, "group_size": 32, "symmetric": True,
                                     "include_lm_head": True, "lm_head_bits": 8}},
                            {"draft": {**QUICK, "kind": "ngram"}}],
                    calibration={"text": str(word_text)}, target={"nbits_accuracy_level": 4},
                    runtime={"block_size": 4, "max_context": 128})
    compile_recipe(recipe, tmp_path / "n", log=lambda _: None)
    manifest = load_manifest(tmp_path / "n")
    reason = unavailable_reason(manifest.graphs["target"], manifest.kv_cache)
    assert reason is None or "AVX-512" in reason or "no native kernels" in reason
    assert manifest.speculative.measured["kernels"] == (
        "native" if reason is None else "onnxruntime")


def test_suffix_ngram_artifacts_keep_their_corpus(target_dir, word_text, tmp_path):
    from llmopt.runtime import LLM, SamplingParams

    with pytest.raises(ValueError, match="corpus needs n-gram drafting with ngram.method"):
        draft.make_config(kind="ngram", corpus="self")
    suffix = {"method": "suffix", "max_n": 6}
    for corpus in (str(word_text), "self"):
        out = compile_with_draft(target_dir, word_text, tmp_path / corpus[-4:], kind="ngram",
                                 ngram=suffix, corpus=corpus, corpus_prompts=4,
                                 corpus_new_tokens=8, corpus_max_tokens=300)
        spec = load_manifest(out).speculative
        assert spec.ngram.method == "suffix" and spec.ngram.corpus == "draft_ngram_corpus.npy"
        corpus_ids = np.load(out / spec.ngram.corpus)
        assert corpus_ids.ndim == 1 and 8 <= corpus_ids.size <= (300 if corpus != "self"
                                                                 else 10_000)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 5, 6, 7]]
    on = LLM(out).generate(prompt, params)[0]
    off = LLM(out, speculative=False).generate(prompt, params)[0]
    assert on.token_ids == off.token_ids


def test_recipe_resolves_the_draft_model_path(target_dir, tmp_path):
    from llmopt.compiler.recipe import load_recipe

    (tmp_path / "drafts" / "small").mkdir(parents=True)
    (tmp_path / "r.yaml").write_text(
        f"model: {target_dir}\npasses:\n  - draft: {{kind: model, model: drafts/small}}\n")
    (entry,) = load_recipe(tmp_path / "r.yaml").passes
    assert entry.config.model == str(tmp_path / "drafts" / "small")


def test_tiny_draft_distilled_on_its_own_continuations(target_dir, word_text, tmp_path):
    manifest = load_manifest(compile_with_draft(
        target_dir, word_text, tmp_path / "s", kind="tiny", num_layers=1, head_vocab=64,
        distill_steps=3, distill_data="self", distill_prompts=4, distill_new_tokens=8))
    report = manifest.passes[0]
    assert report["distill_data"]["data"] == "self" and report["distill_data"]["prompts"] == 4
    assert report["distill_data"]["generation_seconds"] >= 0
    assert report["distillation"]["steps"] == 3 and report["distillation"]["seconds"] >= 0
    assert manifest.speculative.model.kind == "tiny" and manifest.speculative.model.vocab_size == 64


def test_without_calibration_text_a_draft_distills_on_the_targets_samples(target_dir,
                                                                          tmp_path):
    recipe = Recipe(model=str(target_dir), passes=[{"draft": {
        **QUICK, "kind": "tiny", "num_layers": 1, "head_vocab": 64, "distill_steps": 2,
        "distill_seq_len": 16}}], calibration={"samples": 4},
        runtime={"block_size": 4, "max_context": 128})
    lines: list[str] = []
    compile_recipe(recipe, tmp_path / "s", log=lines.append)
    manifest = load_manifest(tmp_path / "s")
    assert manifest.passes[0]["distillation"]["steps"] == 2
    assert any("calibration: sampling 4 sequences of 16 tokens" in line for line in lines)
