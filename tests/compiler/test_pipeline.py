"""The compile pipeline: pass constraints checked before work, passes run in order, the
quality budget enforced."""

from __future__ import annotations

import pytest

from llmopt.compiler import pass_registry as registry
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import (
    PassContext,
    QualityBudgetError,
    apply_passes,
    check_budget,
)
from llmopt.compiler.pass_registry import PassEntry
from llmopt.compiler.pipeline import check_pass_order, compile_recipe
from llmopt.compiler.recipe import Recipe


@pytest.mark.parametrize(("passes", "message"), [
    ([{"rtn": {}}, {"gptq": {}}], "passes 'rtn' and 'gptq' are both weight-quantization"),
    ([{"draft": {"kind": "ngram"}}, {"awq": {}}], "'awq' comes after 'draft', which must be"),
])
def test_constraints_between_passes_fail_before_any_work(tmp_path, passes, message):
    recipe = Recipe(model=str(tmp_path / "never-loaded"), passes=passes)
    with pytest.raises(ValueError, match=message):
        compile_recipe(recipe, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_a_missing_requirement_names_the_pass(monkeypatch):
    monkeypatch.setitem(registry.PASSES, "needs_q",
                        PassEntry("llmopt.passes.rtn", requires=("quantized_weights",)))
    with pytest.raises(ValueError, match="pass 'needs_q' needs quantized_weights"):
        registry.check_order(["needs_q", "rtn"])
    registry.check_order(["rtn", "needs_q"])


def test_a_draft_cannot_pair_a_draft():
    with pytest.raises(ValueError, match="unknown draft pass 'draft'"):
        Recipe(model="m", passes=[{"draft": {"kind": "self", "passes": [{"draft": {}}]}}])


def test_passes_run_in_order_and_report(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=[{"rtn": {"bits": 8, "group_size": 32}}])
    check_pass_order(recipe)
    out, reports = apply_passes(ir, recipe.passes, PassContext(recipe, lambda _: None))
    assert [r["name"] for r in reports] == ["rtn"] and reports[0]["config"]["bits"] == 8
    assert out.quantized and not ir.quantized  # the input IR is left intact


def test_lossy_passes_are_measured_on_the_eval_text(tiny_checkpoints, word_text):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=[{"rtn": {"bits": 4, "group_size": 32}}],
                    quality={"eval_text": str(word_text), "eval_windows": 2,
                             "eval_seq_len": 64})
    _, (report,) = apply_passes(ir, recipe.passes, PassContext(recipe, lambda _: None))
    quality = report["quality"]
    assert quality["tokens"] == 2 * 63 and quality["ppl_before"] > 0 and quality["kl"] > 0


def test_the_quality_budget_fails_a_pass_that_costs_more():
    report = {"quality": {"ppl_before": 10.0, "ppl_after": 10.6, "ppl_increase_pct": 6.0,
                          "kl": 0.1, "top1_agreement": 0.9}}
    check_budget("rtn", report, 6.0, lambda _: None)  # at the budget: allowed
    with pytest.raises(QualityBudgetError, match="pass 'rtn' raised perplexity by 6.00 %"):
        check_budget("rtn", report, 5.0, lambda _: None)


def test_a_folder_that_is_not_an_artifact_is_refused_before_loading(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    recipe = Recipe(model=str(tmp_path / "never-loaded"))
    with pytest.raises(FileExistsError, match="is not an llmopt artifact"):
        compile_recipe(recipe, out, log=lambda _: None)


def test_without_eval_text_the_calibration_texts_tail_is_measured(tiny_checkpoints,
                                                                  word_text):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=[{"rtn": {"bits": 4, "group_size": 32}}],
                    calibration={"text": str(word_text)},
                    quality={"eval_windows": 2, "eval_seq_len": 64})
    context = PassContext(recipe, lambda _: None)
    _, (report,) = apply_passes(ir, recipe.passes, context)
    every = ir.text_token_ids(word_text)
    last = (len(every) // 64) * 64
    assert context.quality_probe(ir).text.windows[-1] == every[last - 64 : last]
    assert report["quality"]["tokens"] == 2 * 63
    # and on the model's own samples, which no calibration text shares a domain with
    on_samples = report["quality"]["on_samples"]
    assert on_samples["tokens"] == 16 * 255 and on_samples["kl"] > 0
    assert on_samples["source"].startswith("16 sequences of 256 tokens sampled")
    off = recipe.model_copy(update={"quality": recipe.quality.model_copy(
        update={"measure": False})})
    _, (report,) = apply_passes(ir, off.passes, PassContext(off, lambda _: None))
    assert report["quality"] is None


def test_the_quality_measurement_reports_its_progress(tiny_checkpoints, word_text):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=[{"rtn": {"bits": 4, "group_size": 32}}],
                    quality={"eval_text": str(word_text), "eval_windows": 3,
                             "eval_seq_len": 64})
    lines: list[str] = []
    apply_passes(ir, recipe.passes, PassContext(recipe, lines.append))
    progress = [line.strip() for line in lines if line.strip().startswith("quality:")]
    opening = progress.index("quality: measuring 3 windows of 64 tokens (the pass's input "
                             "and output models)")
    assert progress[opening + 1].startswith("quality: 3/3 windows, ")
    assert progress[-1].startswith("quality: 16/16 windows, ")  # then the model's samples
    assert any(line.strip().startswith("rtn: on the model's own samples: KL ")
               for line in lines)


def test_the_log_names_only_the_options_a_recipe_set():
    from llmopt.compiler.pass_manager import options_line

    recipe = Recipe(model="m", passes=[
        {"draft": {"kind": "ngram", "ngram": {"max_n": 4}}},
    ])
    assert options_line(recipe.passes[0].config) == (
        "{'ngram': {'max_n': 4}, 'kind': 'ngram'} (other options at their defaults)")


def test_a_pass_that_changes_many_top_choices_is_warned_about_in_words():
    lines: list[str] = []
    quality = {"ppl_before": 10.0, "ppl_after": 14.2, "ppl_increase_pct": 42.0, "kl": 0.35,
               "top1_agreement": 0.646}
    check_budget("rtn", {"quality": quality}, None, lines.append)
    assert lines[-1] == (
        "      warning: after rtn the model picks its input's top token only 64.6 % of the "
        "time: generated text will differ visibly and chat answers may lose coherence; a "
        "calibrated pass (gptq or awq), group_size: 32 or an 8-bit LM "
        "head (lm_head_bits: 8) keeps more")
    lines.clear()
    check_budget("rtn", {"quality": {**quality, "top1_agreement": 0.9}}, None, lines.append)
    assert not any("warning" in line for line in lines)
