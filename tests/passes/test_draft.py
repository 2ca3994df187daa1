"""The draft pass: draft building per kind, tokenizer mapping, distillation, γ choice, and
the artifact's draft graph + manifest.speculative."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pipeline import check_pass_order, compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import draft
from llmopt.passes.draft import model as dm
from llmopt.passes.draft.distill import DistillSettings, distill, held_out_kl
from llmopt.passes.draft.measure import (
    Trajectory,
    best_gamma,
    expected_tokens,
    model_step_cost,
    position_acceptance,
    run_lengths,
    simulate,
)
from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.executor import OrtExecutor
from llmopt.runtime.step_batch import StepBatch

SPECIALS = ["<pad>", "<s>", "</s>"]
TARGET_TOKENS = SPECIALS + [chr(c) for c in range(32, 127)] + [f"w{i}" for i in range(158)]
# Measure little: the tests check the plumbing, not the numbers.
QUICK = {"prompts": 2, "new_tokens": 12, "batch_sizes": [1, 2], "cost_repeats": 1}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def save_draft(directory: Path, tokens: list[str], vocab_size: int) -> Path:
    """A random 1-layer llama whose word-level tokenizer has `tokens` as ids 0.."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = AutoConfig.for_model(
        model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("target") / "llama")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_checkpoint(str(target_dir))


# A subset in another order: the printable characters reversed, 20 of the words, and two
# padding rows past the tokenizer (logits rows that name no token).
SUBSET_TOKENS = SPECIALS + [chr(c) for c in range(126, 31, -1)] + [f"w{i}" for i in range(20)]


@pytest.fixture(scope="module")
def subset_dir(tmp_path_factory) -> Path:
    return save_draft(tmp_path_factory.mktemp("subset") / "d", SUBSET_TOKENS,
                      len(SUBSET_TOKENS) + 2)


def test_identical_vocabulary_passes_unchanged(target, tmp_path):
    same = load_checkpoint(str(save_draft(tmp_path / "same", TARGET_TOKENS, 256)))
    mapped, token_map = dm.map_to_target(same, target)
    assert token_map is None and mapped is same


def test_subset_vocabulary_is_mapped(target, subset_dir):
    original = load_checkpoint(str(subset_dir))
    mapped, token_map = dm.map_to_target(original, target)
    target_id = {t: i for i, t in enumerate(TARGET_TOKENS)}
    assert token_map.tolist() == [target_id[t] for t in SUBSET_TOKENS]  # padding rows dropped
    assert mapped.arch.vocab_size == len(SUBSET_TOKENS)
    assert mapped.weights["embed_tokens"].shape[0] == target.arch.vocab_size
    # The same text in each model's own ids: the mapped draft's logits are the original's
    # rows for the tokens it has.
    text = [t for t in SUBSET_TOKENS[3:] if not t.startswith("w")][:30] + ["w3", "w7"]
    draft_ids = torch.tensor([[SUBSET_TOKENS.index(t) for t in text]])
    target_ids = torch.tensor([[target_id[t] for t in text]])
    expected = ReferenceModel(original).forward(draft_ids)[..., : len(SUBSET_TOKENS)]
    torch.testing.assert_close(ReferenceModel(mapped).forward(target_ids), expected)
    # A target token the draft lacks reads the draft's unk row (<pad>, id 0).
    assert torch.equal(mapped.weights["embed_tokens"][target_id["w100"]],
                       original.weights["embed_tokens"][0])


def test_mismatched_vocabulary_is_refused(target, tmp_path):
    tokens = TARGET_TOKENS[:40] + ["zzz"] + TARGET_TOKENS[41:]
    other = load_checkpoint(str(save_draft(tmp_path / "other", tokens, 256)))
    with pytest.raises(dm.TokenizerMismatchError,
                       match=r"1 of 256 .*40 'zzz'.*first differing token id 40: target 'E', "
                             r"draft 'zzz'"):
        dm.map_to_target(other, target)


def truncated_logits(ir, ids: torch.Tensor, layers: int) -> torch.Tensor:
    model = ReferenceModel(ir)
    hidden, positions = model.embed(ids), torch.arange(ids.shape[1])
    with torch.no_grad():
        for index in range(layers):
            hidden = model.layer_forward(index, hidden, positions, None)
        return model.logits(hidden)


def test_self_draft_is_the_truncated_target(target):
    ids = torch.tensor([list(range(3, 40))])
    got = ReferenceModel(dm.truncated(target, 2)).forward(ids)
    torch.testing.assert_close(got, truncated_logits(target, ids, 2))
    with pytest.raises(ValueError, match="keeps 1..2"):
        dm.truncated(target, 3)


def test_head_trimming_keeps_the_frequent_rows(target):
    ids = torch.tensor([[5, 5, 5, 9, 9, 200, 7]])
    keep = dm.frequent_tokens(ids, 4, always=(2,), vocab_size=256)
    assert keep.tolist() == [2, 5, 7, 9]  # eos always; then 5, 9, and 7 over 200 (lower id)
    trimmed, token_map = dm.trim_head(dm.truncated(target, 1), None, keep)
    assert token_map.tolist() == [2, 5, 7, 9] and trimmed.arch.vocab_size == 4
    probe = torch.tensor([list(range(3, 20))])
    full = ReferenceModel(dm.truncated(target, 1)).forward(probe)
    torch.testing.assert_close(ReferenceModel(trimmed).forward(probe), full[..., keep])


def test_tiny_draft_distillation_lowers_the_kl(target, word_text):
    windows = draft.text_windows(target, word_text, 32)[:40]
    shape = dm.TinyShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64)
    basis = dm.residual_basis(target, draft._residual_states(target, windows[-2:]), 32)
    tiny = dm.sliced_tiny(target, shape, basis, [0])
    assert tiny.arch.hidden_size == 32 and tiny.arch.num_layers == 1
    trained, report = distill(tiny, target, windows, None,
                              DistillSettings(steps=30, lr=3e-3, batch_size=4, trainable=("*",)),
                              log=lambda _: None)
    assert report["held_out_kl_after"] < 0.8 * report["held_out_kl_before"]
    curve = report["loss_curve"]
    assert np.mean(curve[-3:]) < np.mean(curve[:3])
    teacher, student = ReferenceModel(target, 32), ReferenceModel(trained, 32)
    assert held_out_kl(teacher, student, windows[:4], None) == pytest.approx(
        report["held_out_kl_after"], abs=1e-4)


# --- γ and acceptance -------------------------------------------------------------------
def test_expected_tokens_and_gamma_choice():
    alphas = [0.8, 0.5, 0.5, 0.1]
    assert expected_tokens(alphas, 1) == pytest.approx(1.8)
    assert expected_tokens(alphas, 2) == pytest.approx(2.2)
    assert expected_tokens(alphas, 3) == pytest.approx(2.4)
    # draft 0.1 of a target step; verifying γ+1 tokens costs 1 + 0.05 γ target steps
    costs = [model_step_cost(g, 0.1, 1 + 0.05 * g) for g in range(1, 5)]
    tokens = [expected_tokens(alphas, g) for g in range(1, 5)]
    gamma, speedup = best_gamma(tokens, costs)
    # 1.8/1.15 = 1.565, 2.2/1.3 = 1.692, 2.4/1.45 = 1.655, 2.42/1.6 = 1.51
    assert gamma == 2 and speedup == pytest.approx(2.2 / 1.3)
    # A free draft and a free verification: the longest γ wins whenever α > 0.
    assert best_gamma(tokens, [1.0] * 4)[0] == 4


def test_acceptance_per_position_from_run_lengths():
    agree = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=bool)
    runs = run_lengths(agree, cap=2)
    assert runs.tolist() == [2, 1, 0, 1, 0, 0, 2, 2, 1]
    alphas = position_acceptance(runs, 2)
    assert alphas == pytest.approx([6 / 9, 3 / 6])


def test_ngram_simulation_on_a_repeating_trajectory():
    tokens = [5, 6, 7, 8] * 6
    steps = simulate([Trajectory(tokens, prompt_len=8)], gamma=4, ngram=(1, 3))
    assert set(steps.sources) == {"ngram"} and steps.accepted == [4] * 3 + [0]
    assert steps.tokens_per_step() == pytest.approx(16 / 4)
    # With no match and a model draft, the model's teacher-forced agreement decides.
    agree = np.zeros(10, dtype=bool)
    agree[3:6] = True
    steps = simulate([Trajectory(list(range(10)), 3, agree)], gamma=2, ngram=(1, 2))
    assert steps.sources == ["model"] * 5 and steps.accepted == [2, 0, 0, 0, 0]  # 5: a bonus


# --- config and pipeline ----------------------------------------------------------------
def test_config_checks_keys_against_the_kind():
    with pytest.raises(ValueError, match="layers does not apply to kind 'tiny'"):
        draft.Config(kind="tiny", layers=2)
    with pytest.raises(ValueError, match="needs `model: PATH`"):
        draft.Config(kind="model")
    with pytest.raises(ValueError, match="head_vocab does not apply to kind 'ngram'"):
        draft.Config(kind="ngram", head_vocab=10)
    with pytest.raises(ValueError, match="gamma"):
        draft.Config(kind="self", gamma=9)
    with pytest.raises(ValueError, match="unknown draft pass"):
        draft.Config(kind="self", passes=[{"draft": {}}])
    assert draft.Config(kind="self", ngram=True).ngram_options().max_n == 4
    assert draft.Config(kind="ngram").ngram_options().min_n == 1


def test_draft_must_be_the_last_pass(target_dir):
    recipe = Recipe(model=str(target_dir), passes=[{"draft": {"kind": "ngram"}}, {"rtn": {}}])
    with pytest.raises(ValueError, match="must be the last pass"):
        check_pass_order(recipe)


def compile_with_draft(target_dir: Path, text: Path, out: Path, **options) -> Path:
    recipe = Recipe(model=str(target_dir), passes=[{"draft": {**QUICK, **options}}],
                    calibration={"text": str(text)},
                    runtime={"block_size": 4, "max_context": 128})
    compile_recipe(recipe, out, log=lambda _: None)
    return out


def draft_logits(artifact: Path, tokens: list[int]) -> np.ndarray:
    """Run the artifact's draft graph through OrtExecutor with the manifest's draft spec."""
    manifest = load_manifest(artifact)
    spec = manifest.speculative.model
    executor = OrtExecutor(artifact / manifest.graphs[spec.graph].file, spec.kv_cache,
                           num_blocks=64, block_size=4, max_position=spec.max_position)
    slots = np.arange(4, 4 + len(tokens), dtype=np.int64)  # blocks 1.. in order
    batch = StepBatch([tokens], [0], [list(range(1, 1 + len(tokens) // 4 + 1))], slots,
                      np.arange(len(tokens), dtype=np.int64))
    return executor.execute(batch)


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


def test_subset_model_draft_artifact_with_ngram(target_dir, subset_dir, word_text, tmp_path):
    out = compile_with_draft(target_dir, word_text, tmp_path / "b", kind="model",
                             model=str(subset_dir), ngram={"max_n": 3})
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


def test_ngram_only_artifact(target_dir, word_text, tmp_path):
    manifest = load_manifest(compile_with_draft(target_dir, word_text, tmp_path / "c",
                                                kind="ngram"))
    spec = manifest.speculative
    assert set(manifest.graphs) == {"target"} and spec.model is None
    assert spec.ngram.min_n == 1 and 1 <= spec.gamma <= 8 and spec.cost_ratio == 0.0


def test_teacher_logits_on_a_trimmed_head(target):
    from llmopt.passes.draft.distill import teacher_logits

    ids, rows = torch.tensor([list(range(3, 30))]), torch.tensor([2, 9, 40, 200])
    teacher = ReferenceModel(target)
    torch.testing.assert_close(teacher_logits(teacher, ids, rows),
                               teacher.forward(ids)[..., rows])


def test_recipe_resolves_the_draft_model_path(target_dir, tmp_path):
    from llmopt.compiler.recipe import load_recipe

    (tmp_path / "drafts" / "small").mkdir(parents=True)
    (tmp_path / "r.yaml").write_text(
        f"model: {target_dir}\npasses:\n  - draft: {{kind: model, model: drafts/small}}\n")
    (entry,) = load_recipe(tmp_path / "r.yaml").passes
    assert entry.config.model == str(tmp_path / "drafts" / "small")


def test_the_target_as_its_own_draft_is_always_accepted(target, tmp_path):
    """Teacher-forced agreement along the target's own greedy trajectory is exact."""
    from llmopt.passes.draft import measure as m

    recipe = Recipe(model="unused", runtime={"block_size": 4, "max_context": 128})
    runner = m.PagedRunner(draft._executor(target, recipe, tmp_path / "t.onnx", 64), 4, 16)
    (traj,) = m.greedy_trajectories(runner, [[5, 9, 13, 40, 41]], 24, eos_ids=())
    assert len(traj.tokens) == 5 + 24
    agree = m.draft_agreement(runner, traj, None)
    assert agree[5:].all() and not agree[:5].any()


def test_self_distillation_data_is_the_targets_greedy_continuation(target, word_text):
    """`distill_data: self` windows: prompt + the target's greedy argmax chain, the mask
    on exactly the positions that predict continuation tokens."""
    from llmopt.passes.draft import data as draft_data
    from llmopt.passes.draft.choice import target_tokenizer

    recipe = Recipe(model="unused", calibration={"text": str(word_text)},
                    runtime={"block_size": 4, "max_context": 128})
    context = type("Context", (), {"recipe": recipe, "log": staticmethod(lambda _: None)})()
    data = draft._self_windows(target, draft.Config(kind="tiny", distill_data="self",
                                                    distill_prompts=5,
                                                    distill_new_tokens=6), context)
    assert data.report["prompts"] == 5 and data.report["continuation_tokens"] >= 5
    assert data.ids.shape == data.mask.shape and data.mask.sum() == (
        data.report["continuation_tokens"])
    prompts = draft_data.self_prompts(target, target_tokenizer(target), 5, str(word_text))
    logits = ReferenceModel(target).forward(data.ids)
    for row, prompt in enumerate(prompts):
        assert data.ids[row, : len(prompt)].tolist() == prompt
        positions = torch.nonzero(data.mask[row]).flatten()
        assert positions[0] == len(prompt) - 1 and len(positions) <= 6
        assert (logits[row, positions].argmax(-1) == data.ids[row, positions + 1]).all()


def test_tiny_draft_distilled_on_its_own_continuations(target_dir, word_text, tmp_path):
    manifest = load_manifest(compile_with_draft(
        target_dir, word_text, tmp_path / "s", kind="tiny", num_layers=1, head_vocab=64,
        distill_steps=3, distill_data="self", distill_prompts=4, distill_new_tokens=8))
    report = manifest.passes[0]
    assert report["distill_data"]["data"] == "self" and report["distill_data"]["prompts"] == 4
    assert report["distill_data"]["generation_seconds"] >= 0
    assert report["distillation"]["steps"] == 3 and report["distillation"]["seconds"] >= 0
    assert manifest.speculative.model.kind == "tiny" and manifest.speculative.model.vocab_size == 64
