"""What lossy passes are measured on: eval_text, calibration.text past what calibration
reads, else the input model's own seeded samples; never nothing unless told."""

from __future__ import annotations

import pytest

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.model_samples import sample
from llmopt.compiler.pass_manager import PassContext, apply_passes
from llmopt.compiler.quality import SAMPLES, QualityProbe
from llmopt.compiler.recipe import Recipe

RTN = [{"rtn": {"bits": 4, "group_size": 32}}]
GPTQ = [{"gptq": {"bits": 4, "group_size": 32}}]


def test_without_any_text_a_lossy_pass_is_measured_on_the_models_own_samples(
        tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=RTN,
                    quality={"sampled_sequences": 3, "sampled_tokens": 20, "seed": 1})
    lines: list[str] = []
    _, (report,) = apply_passes(ir, recipe.passes, PassContext(recipe, lines.append))
    quality = report["quality"]
    assert quality["tokens"] == 3 * 19 and quality["kl"] > 0
    assert quality["perplexity_on"] == "model samples"
    assert quality["source"] == ("3 sequences of 20 tokens sampled from the input model "
                                 "(seed 1)")
    printed = [line.strip() for line in lines if line.strip().startswith("rtn: perplexity")]
    assert printed and "perplexity of its own samples" in printed[0]
    assert "not a text perplexity" in printed[0] and "top-1 agreement" in printed[0]
    assert any("quality: sampling 3 sequences of 20 tokens" in line for line in lines)


def test_samples_are_seeded_start_at_bos_and_never_hold_eos(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    first = sample(ir, 4, 30, seed=3).tolist()
    assert first == sample(ir, 4, 30, seed=3).tolist()
    assert first != sample(ir, 4, 30, seed=4).tolist()
    start = ir.arch.bos_token_id if ir.arch.bos_token_id is not None else ir.arch.eos_token_ids[0]
    assert all(len(s) == 30 and s[0] == start for s in first)
    assert not set(ir.arch.eos_token_ids) & {t for s in first for t in s[1:]}


def test_calibration_texts_held_out_tail_skips_what_calibration_reads(tiny_checkpoints,
                                                                    word_text):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    every = ir.text_token_ids(word_text)
    recipe = Recipe(model="m", passes=GPTQ, calibration={"text": str(word_text),
                                                         "samples": 4, "seq_len": 64},
                    quality={"eval_windows": 3, "eval_seq_len": 64})
    probe = QualityProbe.for_recipe(recipe, ir)
    rest = every[4 * 64:]
    last = (len(rest) // 64) * 64
    assert probe.windows == [rest[i:i + 64] for i in range(last - 3 * 64, last, 64)]
    assert "held out: calibration reads its first 256 tokens" in probe.source
    calibration = [every[i:i + 64] for i in range(0, 4 * 64, 64)]
    assert not any(window in calibration for window in probe.windows)


def test_a_calibration_text_calibration_reads_whole_falls_back_to_samples(tiny_checkpoints,
                                                                         word_text):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    whole = len(ir.text_token_ids(word_text)) // 64
    recipe = Recipe(model="m", passes=GPTQ, calibration={"text": str(word_text),
                                                         "samples": whole, "seq_len": 64},
                    quality={"sampled_sequences": 2, "sampled_tokens": 8})
    lines: list[str] = []
    probe = QualityProbe.for_recipe(recipe, ir, lines.append)
    assert probe.kind == SAMPLES and len(probe.windows) == 2
    assert any("measuring on model samples instead" in line for line in lines)


def test_measure_false_turns_the_default_off(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=RTN, quality={"measure": False})
    lines: list[str] = []
    _, (report,) = apply_passes(ir, recipe.passes, PassContext(recipe, lines.append))
    assert report["quality"] is None
    assert "rtn: quality not measured (quality.measure is false)" in [s.strip() for s in lines]


def test_a_model_too_large_to_sample_is_measured_on_the_built_in_passages(
        tiny_checkpoints, monkeypatch):
    from llmopt.compiler import quality as quality_module

    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    monkeypatch.setattr(quality_module, "SAMPLING_MAX_PARAMETERS",
                        quality_module.parameter_count(ir) - 1)
    recipe = Recipe(model="m", passes=RTN)
    _, (report,) = apply_passes(ir, recipe.passes, PassContext(recipe, lambda _: None))
    quality = report["quality"]
    assert "built-in English passages" in quality["source"]
    assert quality["perplexity_on"] == "text" and quality["kl"] > 0
    probe = QualityProbe.for_recipe(recipe, ir)
    assert len(probe.windows) == quality_module.PASSAGE_WINDOWS and probe.kind != SAMPLES
    assert quality["tokens"] == len(probe.windows) * (len(probe.windows[0]) - 1)


def test_parameter_count_matches_the_weights(tiny_checkpoints):
    from llmopt.compiler.quality import parameter_count

    for arch in ("llama", "qwen2"):
        ir = load_checkpoint(str(tiny_checkpoints[arch]))
        linears = sum(t.numel() for n, t in ir.weights.items()
                      if n.endswith("proj.weight") or n in ("embed_tokens", "lm_head.weight"))
        assert parameter_count(ir) == linears


def test_a_model_too_large_to_sample_is_streamed_with_the_same_result(tiny_checkpoints,
                                                                      monkeypatch):
    from llmopt.compiler import quality as quality_module

    before = load_checkpoint(str(tiny_checkpoints["llama"]))
    recipe = Recipe(model="m", passes=RTN, quality={"measure": False})
    after, _ = apply_passes(before, recipe.passes, PassContext(recipe, lambda _: None))
    probe = QualityProbe.from_passages(before, 2)
    held = probe.compare(before, after)
    monkeypatch.setattr(quality_module, "SAMPLING_MAX_PARAMETERS",
                        quality_module.parameter_count(before) - 1)
    streamed = probe.compare(before, after)
    assert streamed["tokens"] == held["tokens"] and streamed["kl"] > 0
    for key in ("kl", "top1_agreement", "ppl_before", "ppl_after"):
        assert streamed[key] == pytest.approx(held[key], rel=1e-3), key
