"""GPTQ: numerics on a single linear, the group-wise format it produces, and end to end
through the compiler and the runtime on tiny checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmopt.compiler.calibration import LayerwiseRunner
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pipeline import compile_recipe, run_passes
from llmopt.compiler.quant_format import group_quantize, quant_params
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes.gptq import (
    HessianAccumulator,
    gptq_quantize,
    group_hessian,
    refit_scales,
    row_output_error,
)
from llmopt.runtime import LLM


def correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated features and uneven scales, like a layer's."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, k // 4, generator=gen)
    mix = torch.randn(k // 4, k, generator=gen)
    scales = torch.exp(torch.randn(k, generator=gen))
    return (latent @ mix + 0.1 * torch.randn(tokens, k, generator=gen)) * scales


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return 2 / x.shape[0] * (x.double().T @ x.double())


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_output_error_clearly_below_rtn(act_order, symmetric):
    k, n = 160, 48  # 160 = 2 groups of 64 and a short one of 32
    x = correlated_inputs(4096, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    q, loss = gptq_quantize(w, hessian_of(x), 4, 64, symmetric, act_order)
    rtn = group_quantize(w, 4, 64, symmetric)
    gptq_err = (x @ (w - q.dequantize()).T).norm()
    rtn_err = (x @ (w - rtn.dequantize()).T).norm()
    assert gptq_err < 0.7 * rtn_err
    assert loss > 0


@pytest.mark.parametrize("act_order", [False, True])
def test_loss_is_the_output_error_it_leaves(act_order):
    """With negligible damping, the summed objective Σ err²/[H⁻¹]_jj equals tr(Δ H Δᵀ)
    of the final weight error Δ: the error feedback is exact."""
    x = correlated_inputs(4096, 160)
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(1))
    h = hessian_of(x)
    q, loss = gptq_quantize(w, h, 4, 64, False, act_order, damp=1e-7)
    delta = (w - q.dequantize()).double()
    assert loss == pytest.approx(float(torch.trace(delta @ h @ delta.T)), rel=0.01)


@pytest.mark.parametrize("act_order", [False, True])
def test_isotropic_inputs_give_rtn_exactly(act_order):
    """With H ∝ I no error feeds forward, so GPTQ is round-to-nearest in the same format."""
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(2))
    q, _ = gptq_quantize(w, torch.eye(96) * 3.0, 4, 32, False, act_order)
    rtn = group_quantize(w, 4, 32, False)
    assert torch.equal(q.codes, rtn.codes)
    assert torch.equal(q.scales, rtn.scales) and torch.equal(q.zeros, rtn.zeros)


def test_act_order_keeps_plain_static_groups():
    k, n, group = 160, 24, 64
    x = correlated_inputs(2048, k, seed=3)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    q, _ = gptq_quantize(w, hessian_of(x), 4, group, False, act_order=True)
    scales, zeros = quant_params(w, 4, group, False)  # from the unpermuted float weight
    assert q.shape == (n, k) and q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert q.scales.shape == (n, 3) and torch.equal(q.scales, scales)
    assert torch.equal(q.zeros, zeros)
    assert not torch.equal(q.codes, group_quantize(w, 4, group, False).codes)  # it did work


def test_given_static_groups_are_kept():
    x = correlated_inputs(2048, 160, seed=3)
    w = torch.randn(24, 160, generator=torch.Generator().manual_seed(4))
    clip = torch.full((24, 3), 0.8)
    scales, zeros = quant_params(w, 4, 64, False, clip)
    for act_order in (False, True):
        q, _ = gptq_quantize(w, hessian_of(x), 4, 64, False, act_order, static=(scales, zeros))
        assert torch.equal(q.scales, scales) and torch.equal(q.zeros, zeros)


@pytest.mark.parametrize("symmetric", [False, True])
def test_scale_refit_never_raises_any_rows_error(symmetric):
    x = correlated_inputs(4096, 160, seed=7)
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(8))
    h = hessian_of(x)
    for q in (group_quantize(w, 4, 64, symmetric), gptq_quantize(w, h, 4, 64, symmetric)[0]):
        refit = refit_scales(w, q, h)
        assert torch.equal(refit.codes, q.codes) and torch.equal(refit.zeros, q.zeros)
        before, after = row_output_error(w, q, h), row_output_error(w, refit, h)
        assert (after <= before * (1 + 1e-9)).all()
        assert after.sum() < 0.97 * before.sum()


@pytest.mark.parametrize("act_order", [False, True])
def test_refits_lower_the_output_error(act_order):
    x = correlated_inputs(4096, 160, seed=9)
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(10))
    h = hessian_of(x)
    plain, _ = gptq_quantize(w, h, 4, 64, False, act_order)
    refit, loss = gptq_quantize(w, h, 4, 64, False, act_order, refits=2)
    before, after = row_output_error(w, plain, h), row_output_error(w, refit, h)
    assert (after <= before).all() and after.sum() < 0.9 * before.sum()
    assert loss == pytest.approx(float(after.sum()))


def test_dead_columns():
    x = correlated_inputs(1024, 64, seed=5)
    x[:, [3, 40]] = 0  # inputs that never fire
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    for act_order in (False, True):
        q, loss = gptq_quantize(w, hessian_of(x), 4, 32, False, act_order)
        assert torch.isfinite(q.dequantize()).all() and np.isfinite(loss)
        assert torch.equal(q.dequantize()[:, [3, 40]], torch.zeros(8, 2))


def test_group_hessian_stops_early_but_sees_every_token(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    runner = LayerwiseRunner(ir, torch.randint(3, 256, (5, 24)), batch_size=2)
    runner.advance()  # layer 1, fed by layer 0's outputs
    full = {n: HessianAccumulator() for n in ("q_proj", "o_proj", "gate_proj", "down_proj")}
    runner.run_layer(lambda _, name, x: full[name].add(x) if name in full else None)
    for name, accumulator in full.items():
        assert accumulator.tokens == 5 * 24
        torch.testing.assert_close(group_hessian(runner, name), accumulator.hessian())


def calibration_text(path: Path, chars: int = 3000) -> Path:
    rng = np.random.default_rng(7)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away"]
    text = " ".join(rng.choice(words, size=chars // 3))
    path.write_text(text[:chars] + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(("arch", "include_lm_head", "options"), [
    ("llama", True, {}), ("qwen2", False, {}), ("llama", False, {"clip": True, "refits": 1})])
def test_artifact_equals_fake_quant_reference(arch, include_lm_head, options, tiny_checkpoints,
                                              tmp_path):
    text = calibration_text(tmp_path / "calib.txt")
    gptq = {"bits": 4, "group_size": 32, "act_order": True, "include_lm_head": include_lm_head,
            **options}
    recipe = Recipe(model=str(tiny_checkpoints[arch]), passes=[{"gptq": gptq}],
                    calibration={"text": str(text), "samples": 8, "seq_len": 64},
                    runtime={"block_size": 4, "max_context": 256, "max_num_seqs": 4})
    manifest = compile_recipe(recipe, tmp_path / "out", log=lambda _: None)
    ir, _ = run_passes(load_checkpoint(recipe.model), recipe, log=lambda _: None)
    report = manifest.passes[0]
    assert report["calibration_samples"] == 8
    assert report["calibration_precision"] == "float32"  # a float32 checkpoint
    assert len(report["gptq_loss"]) == 7 * 3 + include_lm_head
    for name, q in ir.quantized.items():
        key = "embed_tokens" if name == "lm_head" else f"{name}.weight"
        assert torch.equal(ir.weights[key], q.dequantize())

    tokens = [int(t) for t in np.random.default_rng(8).integers(3, 256, 60)]
    with torch.no_grad():
        logits = ReferenceModel(ir).forward(torch.tensor([tokens]))[0]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(59), torch.tensor(tokens[1:])]
    got = LLM(tmp_path / "out", max_num_batched_tokens=16).score(tokens)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-4)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_head_quantized_in_row_slices_equals_the_whole(method, tiny_checkpoints, tmp_path,
                                                         monkeypatch):
    """Rows are independent under the shared Hessian (GPTQ) or Gram (AWQ's clip search and
    nearest rounding): slicing a large head changes nothing."""
    from llmopt.compiler import weight_quant

    text = calibration_text(tmp_path / "calib.txt")
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    passes=[{method: {"bits": 4, "group_size": 32, "include_lm_head": True}}],
                    calibration={"text": str(text), "samples": 4, "seq_len": 32,
                                 "model_samples": 0}, quality={"measure": False})
    whole, _ = run_passes(load_checkpoint(recipe.model), recipe, log=lambda _: None)
    monkeypatch.setattr(weight_quant, "ROW_SLICE_BYTES", 4 * 64 * 100)  # 100-row slices of 256
    joined = []  # the slice counts the pass joined: the head's 3 (decoder linears are smaller)
    concat = weight_quant.concat_outputs
    monkeypatch.setattr(weight_quant, "concat_outputs",
                        lambda parts: joined.append(len(parts)) or concat(parts))
    sliced, _ = run_passes(load_checkpoint(recipe.model), recipe, log=lambda _: None)
    assert 3 in joined
    a, b = whole.quantized["lm_head"], sliced.quantized["lm_head"]
    for field in ("codes", "scales", "zeros"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
