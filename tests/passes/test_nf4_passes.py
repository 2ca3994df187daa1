"""GPTQ and AWQ in the `nf4` format: the calibrated methods keep NF4's code book and absmax."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.nf4 import NF4_CODE, codebook_quantize
from llmopt.compiler.pipeline import compile_recipe, run_passes
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes.gptq import gptq_quantize
from llmopt.runtime import LLM


def correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated features and uneven scales, like a layer's."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, k // 4, generator=gen) @ torch.randn(k // 4, k, generator=gen)
    return (latent + 0.1 * torch.randn(tokens, k, generator=gen)) * torch.exp(
        torch.randn(k, generator=gen))


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return 2 / x.shape[0] * (x.double().T @ x.double())


def calibration_text(path: Path) -> Path:
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "far", "away"]
    path.write_text(" ".join(np.random.default_rng(7).choice(words, size=1000)) + "\n")
    return path


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_nf4_output_error_clearly_below_rtn_nf4(act_order):
    k, n = 192, 48
    x = correlated_inputs(4096, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    rtn = codebook_quantize(w, 64)
    q, loss = gptq_quantize(w, hessian_of(x), 4, 64, True, act_order, codebook=rtn)
    assert torch.equal(q.codebook, NF4_CODE) and torch.equal(q.scales, rtn.scales)
    gptq_err = (x @ (w - q.dequantize()).T).norm()
    rtn_err = (x @ (w - rtn.dequantize()).T).norm()
    assert gptq_err < 0.7 * rtn_err and loss > 0


def test_gptq_nf4_isotropic_inputs_give_rtn_nf4_exactly():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(2))
    rtn = codebook_quantize(w, 32, double_quant=True)
    q, _ = gptq_quantize(w, torch.eye(96) * 3.0, 4, 32, True, False, codebook=rtn)
    assert torch.equal(q.codes, rtn.codes) and torch.equal(q.scales, rtn.scales)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_nf4_artifact_equals_its_fake_quant_reference(method, tiny_checkpoints,
                                                                 tmp_path):
    text = calibration_text(tmp_path / "calib.txt")
    options = {"format": "nf4", "group_size": 32, "include_lm_head": method == "gptq"}
    recipe = Recipe(model=str(tiny_checkpoints["llama"]), passes=[{method: options}],
                    calibration={"text": str(text), "samples": 8, "seq_len": 64},
                    quality={"measure": False},
                    runtime={"block_size": 4, "max_context": 256, "max_num_seqs": 4})
    compile_recipe(recipe, tmp_path / "out", log=lambda _: None)
    ir, _ = run_passes(load_checkpoint(recipe.model), recipe, log=lambda _: None)
    assert ir.quantized and all(torch.equal(q.codebook, NF4_CODE) for q in ir.quantized.values())
    tokens = [int(t) for t in np.random.default_rng(8).integers(3, 256, 60)]
    with torch.no_grad():
        logits = ReferenceModel(ir).forward(torch.tensor([tokens]))[0]
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(59), torch.tensor(tokens[1:])]
    got = LLM(tmp_path / "out", kernels="onnxruntime").score(tokens)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-4)
