"""RTN through the whole pipeline: recipe → pass → MatMulNBits graph → runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import QualityBudgetError
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.compiler.weight_quant import target_linears
from llmopt.passes import rtn
from llmopt.runtime import LLM


def recipe(checkpoint: Path, text: Path, operator_set: str = "onnxruntime",
           **rtn_options) -> Recipe:
    return Recipe(
        model=str(checkpoint),
        passes=[{"rtn": rtn_options}],
        target={"operator_set": operator_set},
        quality={"eval_text": str(text), "eval_windows": 2, "eval_seq_len": 64},
        runtime={"block_size": 4, "max_context": 128},
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_artifact_computes_the_fake_quantized_model(arch, tiny_checkpoints, word_text, tmp_path):
    config = {"bits": 4, "group_size": 32, "include_lm_head": arch == "llama"}  # stated
    manifest = compile_recipe(recipe(tiny_checkpoints[arch], word_text, **config), tmp_path / "a",
                              log=lambda _: None)
    report = manifest.passes[0]
    assert report["name"] == "rtn" and report["quality"]["tokens"] == 2 * 63
    ir = load_checkpoint(str(tiny_checkpoints[arch]))
    quantized = rtn.run(ir, rtn.Config(**config), None).ir
    tokens = list(range(3, 43))
    with torch.no_grad():
        logits = ReferenceModel(quantized).forward(torch.tensor([tokens]))[0, :-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(tokens[1:])]
    got = LLM(tmp_path / "a").score(tokens)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-4)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "a" / "target.onnx")).graph.node]
    # Fused QKV, o, fused gate/up, down per layer (+ the LM head): all int4, no float MatMul.
    assert ops.count("MatMulNBits") == 4 * ir.arch.num_layers + config["include_lm_head"]
    float_head = not config["include_lm_head"] and not ir.arch.tie_word_embeddings
    assert ops.count("MatMul") == float_head  # only an untied, unquantized LM head


def test_budget_fails_the_compile_and_writes_nothing(tiny_checkpoints, word_text, tmp_path):
    # One group per 64-wide row: costs this tiny model about +40 % perplexity.
    strict = recipe(tiny_checkpoints["llama"], word_text, bits=4, group_size=128)
    strict = strict.model_copy(update={"quality": strict.quality.model_copy(
        update={"max_ppl_increase_pct": 1.0})})
    with pytest.raises(QualityBudgetError, match="max_ppl_increase_pct"):
        compile_recipe(strict, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_target_selection(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    names = target_linears(ir, rtn.Config(skip=["layers.0.*", "*.down_proj"],
                                          include_lm_head=True))
    assert "layers.0.q_proj" not in names and "layers.1.down_proj" not in names
    assert names[-1] == "lm_head" and "layers.1.q_proj" in names
    once = rtn.run(ir, rtn.Config(), None).ir
    with pytest.raises(ValueError, match="already quantized"):
        rtn.run(once, rtn.Config(), None)


@pytest.mark.parametrize("symmetric", [False, True])
def test_standard_onnx_form_computes_the_same(symmetric, tiny_checkpoints, word_text, tmp_path):
    """Blocked DequantizeLinear → MatMul (what TensorRT takes; symmetric: signed int4 with
    no zero points) gives the fake-quantized model's numbers under ONNX Runtime too."""
    config = {"bits": 4, "group_size": 32, "symmetric": symmetric, "include_lm_head": False}
    compile_recipe(recipe(tiny_checkpoints["llama"], word_text, "standard", **config),
                   tmp_path / "std", log=lambda _: None)
    graph = onnx.load(str(tmp_path / "std" / "target.onnx"))
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 4 * 3 and all(n.domain == "" for n in graph.graph.node)
    assert all((len(n.input) == 2) == symmetric for n in dq)  # no zero point when symmetric
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    quantized = rtn.run(ir, rtn.Config(**config), None).ir
    tokens = list(range(3, 43))
    with torch.no_grad():
        logits = ReferenceModel(quantized).forward(torch.tensor([tokens]))[0, :-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(tokens[1:])]
    np.testing.assert_allclose(LLM(tmp_path / "std").score(tokens), expected.numpy(), atol=1e-4)


def test_the_recipe_picks_the_quantized_matmul_form(tiny_checkpoints, word_text, tmp_path):
    """`target.quantized_matmul` chooses DequantizeLinear → MatMul beside ONNX Runtime's
    fused operators (both forms are benchmarked); the numbers stay the same."""
    scores = {}
    for form in ("matmul_nbits", "dequantize_linear"):
        base = recipe(tiny_checkpoints["llama"], word_text, bits=4, group_size=32,
                      include_lm_head=False)
        r = base.model_copy(update={"target": base.target.model_copy(
            update={"quantized_matmul": form})})
        compile_recipe(r, tmp_path / form, log=lambda _: None)
        ops = {n.op_type for n in onnx.load(str(tmp_path / form / "target.onnx")).graph.node}
        assert ("DequantizeLinear" in ops) == (form == "dequantize_linear")
        assert ("MatMulNBits" in ops) == (form == "matmul_nbits")
        scores[form] = LLM(tmp_path / form).score(list(range(3, 43)))
    np.testing.assert_allclose(scores["matmul_nbits"], scores["dequantize_linear"], atol=1e-4)


def test_lm_head_takes_its_own_bits(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    out = rtn.run(ir, rtn.Config(bits=4, group_size=32, include_lm_head=True, lm_head_bits=8),
                  None).ir
    assert out.quantized["lm_head"].bits == 8 and out.quantized["layers.0.q_proj"].bits == 4
    with pytest.raises(ValueError, match="include_lm_head"):
        rtn.Config(include_lm_head=False, lm_head_bits=8)


def test_defaults_quantize_the_head_at_8_bits_for_int8_activations(tiny_checkpoints):
    """An unset head is the native step's: 8-bit codes (nf4: its own code book), and the
    recipe's unset accuracy level follows it to 4; a stated head keeps level 0."""
    out = rtn.run(load_checkpoint(str(tiny_checkpoints["llama"])),
                  rtn.Config(bits=4, group_size=32), None).ir
    assert out.quantized["lm_head"].bits == 8 and out.quantized["layers.0.q_proj"].bits == 4
    assert rtn.Config(format="nf4", group_size=64).head_bits() == 4
    assert rtn.Config(bits=4, include_lm_head=True).head_bits() == 4
    levels = [Recipe(model="unused", passes=[{"rtn": head}]).target.nbits_accuracy_level
              for head in ({}, {"include_lm_head": True}, {"include_lm_head": False})]
    assert levels == [4, 0, 0]
    stated = Recipe(model="unused", passes=[{"rtn": {}}], target={"nbits_accuracy_level": 0})
    assert stated.target.nbits_accuracy_level == 0


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_tied_quantized_head_is_also_the_embedding_gathered_from_its_codes(
        symmetric, tiny_checkpoints, word_text, tmp_path):
    config = {"bits": 4, "group_size": 32, "symmetric": symmetric, "include_lm_head": True}
    compile_recipe(recipe(tiny_checkpoints["llama"], word_text, **config), tmp_path / "a",
                   log=lambda _: None)  # llama's head is tied to its embedding
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    quantized = rtn.run(ir, rtn.Config(**config), None).ir
    head = quantized.quantized["lm_head"].dequantize()
    assert torch.equal(quantized.weights["embed_tokens"], head)  # one tied tensor
    tokens = list(range(3, 43))
    with torch.no_grad():
        logits = ReferenceModel(quantized).forward(torch.tensor([tokens]))[0, :-1]
    expected = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(tokens[1:])]
    np.testing.assert_allclose(LLM(tmp_path / "a").score(tokens), expected.numpy(), atol=1e-4)
    graph = onnx.load(str(tmp_path / "a" / "target.onnx"), load_external_data=False).graph
    assert "GatherBlockQuantized" in [n.op_type for n in graph.node]
    assert "embed_tokens" not in {i.name for i in graph.initializer}  # no float table
