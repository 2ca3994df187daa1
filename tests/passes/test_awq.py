"""AWQ: scale folding is exact, the scale search beats RTN where activations have outliers,
and an AWQ artifact computes what the fake-quantized reference computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext
from llmopt.compiler.pipeline import compile_recipe, run_passes
from llmopt.compiler.quant_format import group_quantize
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import awq, rtn
from llmopt.passes.gptq import gptq_quantize
from llmopt.runtime import LLM

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tokens(count: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(3, 256, count))[None]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_folding_scales_is_exact_before_quantization(arch, tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints[arch]))
    folded = ir.copy()
    generator = torch.Generator().manual_seed(0)
    for layer, spec in enumerate(ir.arch.layers):
        for group in awq.SCALE_GROUPS:
            tie = spec.num_heads // spec.num_kv_heads if group.per_kv_head else 1
            prev = folded.weights.get(f"layers.{layer}.{group.prev}",
                                      folded.weights.get(f"layers.{layer}.{group.prev}.weight"))
            s = torch.exp(torch.randn(prev.shape[0], generator=generator))
            awq.fold_scale(folded, f"layers.{layer}.{group.prev}",
                           [f"layers.{layer}.{n}" for n in group.linears], s, (tie, spec.head_dim))
    if arch == "qwen2":
        assert not torch.equal(folded.weights["layers.0.v_proj.bias"],
                               ir.weights["layers.0.v_proj.bias"])
    ids = tokens(40)
    expected = ReferenceModel(ir).forward(ids)
    got = ReferenceModel(folded).forward(ids)
    assert (got - expected).abs().max() < 1e-5 * max(1.0, float(expected.abs().max()))


def outlier_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [2048, 256] with 4 channels 30x larger than the rest, and a weight [96, 256]."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 256, generator=generator)
    x[:, [3, 70, 141, 200]] *= 30
    return x, torch.randn(96, 256, generator=generator)


@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quant_is_group_quantize(symmetric):
    w = torch.randn(48, 200)  # a short last group
    clip = torch.rand(48, 4) * 0.5 + 0.5
    config = awq.Config(bits=4, group_size=64, symmetric=symmetric)
    for c in (None, clip):
        expected = group_quantize(w, 4, 64, symmetric, c).dequantize()
        assert torch.equal(awq.fake_quant(w, config, c), expected)


@pytest.mark.parametrize("duo_scaling", [False, True])
def test_scale_search_beats_rtn_on_outlier_channels(duo_scaling):
    x, w = outlier_layer()
    config = awq.Config(bits=4, group_size=64, grid=20, clip=False, duo_scaling=duo_scaling)
    alpha, s, ratio = awq.search_scale([w], x.abs().mean(0), x.T @ x / len(x), (1, 1), config)
    expected = x @ w.T
    rtn_error = (x @ awq.fake_quant(w, config).T - expected).pow(2).mean()
    awq_error = ((x / s) @ awq.fake_quant(w * s, config).T - expected).pow(2).mean()
    assert alpha > 0
    assert awq_error < 0.5 * rtn_error
    assert ratio == pytest.approx(float(awq_error / rtn_error), rel=1e-3)


def test_scale_search_in_bfloat16_picks_the_float32_scale():
    x, w = outlier_layer(seed=1)
    config = awq.Config(bits=4, group_size=64, grid=20, clip=False)
    gram = x.T @ x / len(x)
    exact = awq.search_scale([w], x.abs().mean(0), gram, (1, 1), config)
    rounded = awq.search_scale([w], x.abs().mean(0), gram.bfloat16(), (1, 1), config)
    assert rounded[0] == exact[0]
    assert torch.equal(rounded[1], exact[1])
    assert rounded[2] == pytest.approx(exact[2], rel=1e-2)


def test_clip_search_never_raises_output_error():
    x, w = outlier_layer(seed=1)
    config = awq.Config(bits=4, group_size=64)
    clip = awq.search_clip(w, x.T @ x / len(x), config)
    assert clip.shape == (96, 4) and clip.min() >= 0.5 and clip.max() == 1.0
    expected = x @ w.T
    unclipped = (x @ awq.fake_quant(w, config).T - expected).pow(2).mean()
    clipped = (x @ awq.fake_quant(w, config, clip).T - expected).pow(2).mean()
    assert clipped < unclipped


def test_gptq_rounding_beats_either_method_alone():
    """AWQ's scales and clipping, then GPTQ's walk under the scaled Gram, leave less output
    error than AWQ's nearest rounding or GPTQ on the unscaled weight."""
    x, w = outlier_layer(seed=2)
    gram = x.T @ x / len(x)
    config = awq.Config(bits=4, group_size=64)
    _, s, _ = awq.search_scale([w], x.abs().mean(0), gram, (1, 1), config)
    scaled, scaled_gram = w * s, gram / (s[:, None] * s[None, :])
    clip = awq.search_clip(scaled, scaled_gram, config)
    alone = awq.output_error(scaled - awq.fake_quant(scaled, config, clip), scaled_gram)
    gptq_alone = awq.output_error(w - gptq_quantize(w, gram, 4, 64, False)[0].dequantize(),
                                  gram)
    q, _ = awq.round_weight(scaled, scaled_gram, awq.Config(bits=4, group_size=64), "gptq")
    combined = awq.output_error(scaled - q.dequantize(), scaled_gram)
    assert combined < 0.95 * min(alone, gptq_alone)


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    """Random printable text: the tiny tokenizer gives one token per character."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("".join(chr(c) for c in rng.integers(32, 127, 4000)))
    return path


def recipe(checkpoint, calibration_text, **options) -> Recipe:
    return Recipe(model=str(checkpoint), passes=[{"awq": options}],
                  calibration={"text": str(calibration_text), "samples": 8, "seq_len": 64},
                  runtime={"block_size": 4, "max_context": 256, "max_num_seqs": 4})


def test_one_alpha_without_clipping_is_rtn(tiny_checkpoints, calibration_text):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    r = recipe(tiny_checkpoints["llama"], calibration_text, grid=1, clip=False,
               duo_scaling=False, group_size=32, rounding="rtn")
    out = awq.run(ir, r.passes[0].config, PassContext(r, log=lambda _: None)).ir
    base = rtn.run(ir, rtn.Config(group_size=32), None).ir
    assert set(out.quantized) == set(base.quantized)
    for name, q in out.quantized.items():
        assert torch.equal(q.codes, base.quantized[name].codes)
        assert torch.allclose(q.scales, base.quantized[name].scales)


@pytest.mark.parametrize(("arch", "options"), [
    ("llama", {"group_size": 32, "include_lm_head": False}),
    ("qwen2", {"group_size": 32, "symmetric": True, "include_lm_head": True,
               "duo_scaling": False}),
    ("llama", {"group_size": 32, "rounding": "gptq", "refits": 1, "include_lm_head": True}),
])
def test_artifact_equals_fake_quant_reference(arch, options, tiny_checkpoints, calibration_text,
                                              tmp_path):
    r = recipe(tiny_checkpoints[arch], calibration_text, grid=5, **options)
    ir, reports = run_passes(load_checkpoint(r.model), r, log=lambda _: None)
    report = reports[0]
    assert report["linears"] == 21 + options.get("include_lm_head", False)
    assert all(0 <= v["alpha"] < 1 for v in report["awq"]["scales"].values())
    compile_recipe(r, tmp_path / "awq", log=lambda _: None)
    ids = tokens(60, seed=3)
    logp = torch.log_softmax(ReferenceModel(ir).forward(ids)[0], dim=-1)
    expected = logp[torch.arange(59), ids[0, 1:]].numpy()
    got = LLM(tmp_path / "awq", max_num_batched_tokens=16).score(ids[0].tolist())
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_a_large_output_error_takes_every_thread_inside_a_one_thread_search(monkeypatch):
    from llmopt.compiler import weight_quant

    d, gram = torch.randn(64, 256), torch.randn(256, 256)
    expected = weight_quant.output_error(d, gram)
    seen = []
    product = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: seen.append(torch.get_num_threads()) or product(a, b))
    monkeypatch.setattr(weight_quant, "LARGE_PRODUCT", d.numel() * 256)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the process's count, which the searches lower to one
    try:
        with weight_quant.intra_op_threads(1):
            assert weight_quant.output_error(d, gram) == expected
            assert torch.get_num_threads() == 1
            small = weight_quant.output_error(d[:8], gram)
            assert small == weight_quant.output_error(d[:8], gram)
    finally:
        torch.set_num_threads(previous)
    assert seen == [2, 1, 1]
