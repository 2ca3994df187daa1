"""GQA regrouping: the merge algebra (RoPE exactness, value folding), the pass's choices
and errors, and end to end through the compiler and the runtime on tiny checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from llmopt.compiler.head_merge import AttentionWeights, merge_heads
from llmopt.compiler.hf_export import export_hf
from llmopt.compiler.ir import LayerSpec
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext, QualityBudgetError
from llmopt.compiler.pass_registry import check_order
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel, apply_rope
from llmopt.passes import gqa_regroup
from llmopt.runtime import LLM
from llmopt.tools.evaluate import perplexity
from llmopt.tools.inspect import describe

pytestmark = pytest.mark.usefixtures("single_torch_thread")
SPEC = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=8)


def scores_and_outputs(w: AttentionWeights, spec: LayerSpec, x: torch.Tensor):
    """Per query head: RoPE'd q·k scores [H, T, T] and o_proj-projected values [H, T, E]."""
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    d, tokens = spec.head_dim, x.shape[0]
    inv_freq = 1 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * inv_freq
    q = apply_rope((x @ w.q.T).view(1, tokens, -1, d), angles.cos(), angles.sin())[0]
    k = apply_rope((x @ w.k.T).view(1, tokens, -1, d), angles.cos(), angles.sin())[0]
    v = (x @ w.v.T).view(tokens, -1, d)
    group = spec.num_heads // spec.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k)
    o = w.o.view(w.o.shape[0], spec.num_heads, d)
    return scores, torch.einsum("thd,ehd->hte", v, o)


def random_weights(seed: int, hidden: int = 16, spec: LayerSpec = SPEC) -> AttentionWeights:
    gen = torch.Generator().manual_seed(seed)
    d = spec.head_dim
    return AttentionWeights(
        torch.randn(spec.num_heads * d, hidden + 1, generator=gen, dtype=torch.float64),
        torch.randn(spec.num_kv_heads * d, hidden + 1, generator=gen, dtype=torch.float64),
        torch.randn(spec.num_kv_heads * d, hidden + 1, generator=gen, dtype=torch.float64),
        torch.randn(hidden, spec.num_heads * d, generator=gen, dtype=torch.float64))


def moments(x: torch.Tensor) -> torch.Tensor:
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    return x.T @ x / x.shape[0]


def test_full_rank_merge_is_a_change_of_basis():
    """Merging to the same KV head count rotates and rescales planes and value bases, and
    changes no score and no output (float64, exact to rounding)."""
    w = random_weights(0)
    x = torch.randn(12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    merged = merge_heads(w, SPEC, 2, moments(x), "aligned")
    for before, after in zip(scores_and_outputs(w, SPEC, x), scores_and_outputs(merged, SPEC, x),
                             strict=True):
        torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)


def test_aligned_merge_is_exact_for_rotated_heads_and_mean_pooling_is_not():
    """Key head 1 = head 0 with every rotary plane turned by its own angle, value head 1 =
    an orthogonal map of value head 0: one shared head loses nothing when fitted, while
    averaging the projections does."""
    w = random_weights(2)
    d, half = SPEC.head_dim, SPEC.head_dim // 2
    phase = torch.rand(half, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    planes = torch.complex(w.k[:half], w.k[half:d]) * torch.exp(2j * math.pi * phase)[:, None]
    rotation = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0]
    k = torch.cat([w.k[:d], planes.real, planes.imag])
    v = torch.cat([w.v[:d], rotation @ w.v[:d]])
    w = AttentionWeights(w.q, k, v, w.o)
    x = torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    one = LayerSpec(4, 1, d)
    reference = scores_and_outputs(w, SPEC, x)
    aligned = scores_and_outputs(merge_heads(w, SPEC, 1, moments(x), "aligned"), one, x)
    mean = scores_and_outputs(merge_heads(w, SPEC, 1, moments(x), "mean"), one, x)
    for exact, fitted, pooled in zip(reference, aligned, mean, strict=True):
        torch.testing.assert_close(fitted, exact, rtol=1e-8, atol=1e-8)
        assert (pooled - exact).norm() > 0.1 * exact.norm()


@pytest.fixture(scope="module")
def mha_checkpoint(tmp_path_factory) -> Path:
    """Llama with 8 query heads and 8 KV heads (MHA), head dim 8."""
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("mha") / "llama_mha",
                                 overrides={"num_attention_heads": 8, "num_key_value_heads": 8,
                                            "head_dim": 8})


def recipe(checkpoint: Path, text: Path, passes: list, **quality) -> Recipe:
    return Recipe(
        model=str(checkpoint), passes=passes,
        calibration={"text": str(text), "samples": 8, "seq_len": 64},
        quality={"eval_text": str(text), "eval_windows": 2, "eval_seq_len": 64, **quality},
        runtime={"block_size": 4, "max_context": 128},
    )


def regrouped(checkpoint: Path, text: Path, **options):
    context = PassContext(recipe(checkpoint, text, []), lambda _: None)
    ir = load_checkpoint(str(checkpoint))
    return ir, gqa_regroup.run(ir, gqa_regroup.Config(**options), context)


def test_original_head_count_is_an_identity(tiny_checkpoints, word_text):
    ir, result = regrouped(tiny_checkpoints["qwen2"], word_text, kv_heads=2, layers=[0, 1, 2])
    tokens = torch.tensor([list(range(3, 43))])
    torch.testing.assert_close(ReferenceModel(result.ir).forward(tokens),
                               ReferenceModel(ir).forward(tokens), rtol=0, atol=1e-5)
    assert result.report["kv_cache_reduction"] == 0


@pytest.mark.parametrize("case", ["mha_8_to_2", "mha_8_to_1", "qwen2_bias_2_to_1"])
def test_artifact_computes_the_regrouped_model(case, mha_checkpoint, tiny_checkpoints, word_text,
                                               tmp_path):
    checkpoint = tiny_checkpoints["qwen2"] if case.startswith("qwen2") else mha_checkpoint
    kv_heads = int(case[-1])
    options = {"kv_heads": kv_heads, "layers": [0, 2], "fit_steps": 20}
    manifest = compile_recipe(recipe(checkpoint, word_text, [{"gqa_regroup": options}]),
                              tmp_path / "a", log=lambda _: None)
    report = manifest.passes[0]
    assert report["layers_merged"] == [0, 2] and report["quality"]["tokens"] == 2 * 63
    assert report["quality_mean_pooling"]["tokens"] == 2 * 63
    ir, result = regrouped(checkpoint, word_text, **options)
    original = ir.arch.layers[1].num_kv_heads
    assert [s.num_kv_heads for s in result.ir.arch.layers] == [kv_heads, original, kv_heads]
    slots = [math.prod(layer.tensors[0].slot_shape) for layer in manifest.kv_cache.layers]
    assert slots == [s.num_kv_heads * s.head_dim for s in result.ir.arch.layers]
    info = describe(tmp_path / "a")
    assert info["kv_bytes_per_token"] == report["kv_bytes_per_token"]["after"]
    assert info["kv_heads_per_layer"] == [kv_heads, original, kv_heads]
    tokens = list(range(3, 43))
    with torch.no_grad():
        logits = ReferenceModel(result.ir).forward(torch.tensor([tokens]))[0, :-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(tokens[1:])]
    llm = LLM(tmp_path / "a")
    np.testing.assert_allclose(llm.score(tokens), expected.numpy(), atol=1e-4)
    ppl = perplexity(llm, word_text, windows=2, seq_len=64).ppl
    assert ppl == pytest.approx(report["quality"]["ppl_after"], rel=0.005)


def test_auto_choice_meets_the_reduction_by_sensitivity(tiny_checkpoints, word_text):
    _, result = regrouped(tiny_checkpoints["llama"], word_text, kv_heads=1,
                          kv_cache_reduction=0.3, sensitivity_windows=2, fit="layer",
                          fit_steps=5)
    report = result.report
    sensitivity = {int(i): v for i, v in report["sensitivity_kl"].items()}
    assert sorted(sensitivity) == [0, 1, 2] and all(v >= 0 for v in sensitivity.values())
    chosen = report["layers_merged"]
    assert len(chosen) == 2 and report["kv_cache_reduction"] >= 0.3
    (left,) = set(sensitivity) - set(chosen)
    assert sensitivity[left] >= max(sensitivity[i] for i in chosen)
    assert set(report["fit_relative_error"]) == {str(i) for i in chosen}
    assert "quality_before_fit" in report and "quality_mean_pooling" in report


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_end_to_end_fit_brings_the_merged_model_closer_to_the_original(precision,
                                                                       tiny_checkpoints,
                                                                       word_text):
    """The fit lowers the calibration KL it minimizes, and the held-out quality probe (the
    recipe's eval text, not the calibration windows) agrees: lower KL than before the fit."""
    _, result = regrouped(tiny_checkpoints["llama"], word_text, kv_heads=1, layers=[0, 1],
                          fit_steps=40, fit_lr=3e-3, fit_precision=precision)
    report = result.report
    assert report["fit_precision"] == precision
    first, last = report["fit_kl"]
    assert last < 0.8 * first
    assert report["quality"]["kl"] < report["quality_before_fit"]["kl"]
    assert report["quality"]["kl"] < report["quality_mean_pooling"]["kl"]


def test_held_out_windows_keep_the_step_that_generalizes(tiny_checkpoints, word_text):
    """A fit that diverges (learning rate far too high) gets worse on the windows it never
    reads: the merge as it was before the fit is kept; a sane fit keeps a later step."""
    kwargs = {"kv_heads": 1, "layers": [0, 1], "fit_steps": 20, "held_out_windows": 2}
    _, wild = regrouped(tiny_checkpoints["llama"], word_text, fit_lr=10.0, **kwargs)
    assert wild.report["kept_step"] == 0
    before, kept = wild.report["held_out_kl"]
    assert kept == before
    assert wild.report["quality"] == wild.report["quality_before_fit"]  # the merge, unfitted
    _, sane = regrouped(tiny_checkpoints["llama"], word_text, fit_lr=3e-3, **kwargs)
    assert sane.report["kept_step"] > 0
    assert sane.report["held_out_kl"][1] < sane.report["held_out_kl"][0]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_qk_norm_is_refused(arch, tiny_checkpoints, word_text):
    with pytest.raises(ValueError, match="qk-norm"):
        regrouped(tiny_checkpoints[arch], word_text, kv_heads=1, layers=[0])


def test_bad_options_are_refused(tiny_checkpoints, word_text):
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        regrouped(tiny_checkpoints["llama"], word_text, kv_heads=3, layers=[0])
    with pytest.raises(ValueError, match="out of range"):
        regrouped(tiny_checkpoints["llama"], word_text, kv_heads=1, layers=[5])
    with pytest.raises(ValueError, match="needs kv_cache_reduction"):
        gqa_regroup.Config(kv_heads=1)
    with pytest.raises(ValueError, match="saves 0.500 of the KV cache"):
        regrouped(tiny_checkpoints["llama"], word_text, kv_heads=1, kv_cache_reduction=0.9)


def test_runs_before_quantization_and_the_draft():
    check_order(["gqa_regroup", "gptq"])
    with pytest.raises(ValueError, match="'gqa_regroup' must come before 'gptq'"):
        check_order(["gptq", "gqa_regroup"])
    with pytest.raises(ValueError, match="'draft'"):
        check_order(["draft", "gqa_regroup"])


def test_with_gptq_and_int8_kv_reports_each_cost_and_the_budget_fails_the_compile(
        tiny_checkpoints, word_text, tmp_path):
    passes = [{"gqa_regroup": {"kv_heads": 1, "layers": [1], "fit_steps": 20}},
              {"gptq": {"bits": 4, "group_size": 32}}, {"kv_cache": {"dtype": "int8"}}]
    manifest = compile_recipe(recipe(tiny_checkpoints["qwen2"], word_text, passes),
                              tmp_path / "a", log=lambda _: None)
    assert [r["name"] for r in manifest.passes] == ["gqa_regroup", "gptq", "kv_cache"]
    assert [t.dtype for t in manifest.kv_cache.layers[1].tensors][0] == "int8"
    assert all(r["seconds"] > 0 and r["quality"]["tokens"] for r in manifest.passes)
    assert LLM(tmp_path / "a").generate([list(range(3, 13))])[0]
    mean = [{"gqa_regroup": {"kv_heads": 1, "layers": [0, 1, 2], "method": "mean",
                             "fit_steps": 0, "max_ppl_increase_pct": 1.0}}]
    with pytest.raises(QualityBudgetError, match="gqa_regroup"):
        compile_recipe(recipe(tiny_checkpoints["qwen2"], word_text, mean), tmp_path / "b",
                       log=lambda _: None)
    assert not (tmp_path / "b").exists()


def test_export_refuses_mixed_kv_heads(tiny_checkpoints, word_text, tmp_path):
    _, result = regrouped(tiny_checkpoints["llama"], word_text, kv_heads=1, layers=[0])
    with pytest.raises(ValueError, match="different KV head counts"):
        export_hf(result.ir, tmp_path / "hf")
