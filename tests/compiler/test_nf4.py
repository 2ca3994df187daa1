"""The `nf4` weight format: code-book quantization, its layouts, recipes, and both graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from test_bnb_checkpoints import write_bnb
from test_lower import compile_graph, open_session, prompt_ids, reference_logits

from llmopt.compiler.artifact_reader import read_artifact
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.nf4 import NF4_CODE, codebook_quantize, pack_bnb, unpack_bnb
from llmopt.compiler.pipeline import compile_recipe, run_passes
from llmopt.compiler.quant_format import pack_matmul_nbits
from llmopt.compiler.recipe import Recipe, RecipeError, load_recipe
from llmopt.passes import rtn


def test_each_value_takes_the_nearest_code():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    q = codebook_quantize(w, 64)
    absmax = w.reshape(8, 2, 64).abs().amax(-1)
    assert torch.equal(q.scales, absmax)
    scaled = (w.reshape(8, 2, 64) / absmax[..., None]).reshape(8, 128)
    brute = (scaled[..., None] - NF4_CODE).abs().argmin(-1)
    assert torch.equal(q.codes.long(), brute)
    assert torch.equal(q.dequantize(), NF4_CODE[brute] * absmax.repeat_interleave(64, 1))


def test_bitsandbytes_packs_the_first_code_high():
    codes = torch.tensor([1, 2, 15, 0, 7], dtype=torch.uint8)
    packed = pack_bnb(codes)
    assert packed.flatten().tolist() == [0x12, 0xF0, 0x70]
    assert torch.equal(unpack_bnb(packed, 5), codes)


def test_double_quantization_rounds_the_absmax_to_8_bits():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    plain, double = codebook_quantize(w, 64), codebook_quantize(w, 64, double_quant=True)
    assert not torch.equal(plain.scales, double.scales)
    spread = (plain.scales - plain.scales.mean()).abs().max()
    assert (plain.scales - double.scales).abs().max() <= spread / 255 * 1.01


def test_integer_packings_refuse_a_code_book():
    with pytest.raises(ValueError, match="code-book weights"):
        pack_matmul_nbits(codebook_quantize(torch.randn(4, 64), 32))


@pytest.mark.parametrize(("options", "message"), [
    ("{format: nf4, bits: 8}", "format nf4 is a 4-bit code book"),
    ("{format: nf4, include_lm_head: true, lm_head_bits: 8}", "format nf4 is a 4-bit"),
    ("{double_quant: true}", "double_quant needs format: nf4"),
    ("{format: nf5}", "passes.0.rtn.format"),
])
def test_bad_nf4_recipes_are_refused_in_one_line(tmp_path, options, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model: /no/such/model\npasses:\n  - rtn: {options}\n")
    with pytest.raises(RecipeError, match=message) as error:
        load_recipe(path)
    assert "\n" not in str(error.value).strip()


@pytest.mark.parametrize("operator_set", ["onnxruntime", "standard"])
def test_rtn_nf4_lowers_to_what_the_reference_computes(load_ir, tmp_path, paged_driver,
                                                       operator_set):
    config = rtn.Config(format="nf4", group_size=32, double_quant=True, include_lm_head=True)
    ir = rtn.run(load_ir("llama"), config, None).ir  # tied head: the table is its dequantization
    assert all(q.codebook is not None for q in ir.quantized.values())
    model, path = compile_graph(ir, tmp_path / "graph", operator_set=operator_set)
    ops = {n.op_type for n in model.graph.node}
    assert ("MatMulBnb4" in ops) == (operator_set == "onnxruntime")
    prompt = prompt_ids(30, seed=4)
    logits = paged_driver(open_session(path), ir.arch).step({0: prompt})[0]
    np.testing.assert_allclose(logits, reference_logits(ir, prompt), rtol=0, atol=1e-4)


def test_an_nf4_source_stays_exact_in_the_artifact(tiny_checkpoints, tmp_path):
    """A bitsandbytes NF4 checkpoint compiled with no weight pass keeps its codes and absmax."""
    out = write_bnb(tiny_checkpoints["llama"], tmp_path, "nf4", True)
    source = load_checkpoint(str(out / "bnb"))
    recipe = Recipe(model=str(out / "bnb"), passes=[], quality={"measure": False},
                    runtime={"block_size": 4, "max_context": 64, "max_num_seqs": 2})
    compile_recipe(recipe, tmp_path / "artifact", log=lambda _: None)
    graph = onnx.load(str(next((tmp_path / "artifact").glob("*.onnx"))))
    weights = {t.name: t for t in graph.graph.initializer}
    q = source.quantized["layers.1.down_proj"]
    packed = numpy_helper.to_array(weights["layers.1.down_proj.B"], str(tmp_path / "artifact"))
    absmax = numpy_helper.to_array(weights["layers.1.down_proj.absmax"],
                                   str(tmp_path / "artifact"))
    assert np.array_equal(packed, pack_bnb(q.codes).numpy().reshape(-1))
    assert np.array_equal(absmax, q.scales.numpy().reshape(-1))


@pytest.mark.parametrize("operator_set", ["onnxruntime", "standard"])
def test_a_compiled_nf4_artifact_reads_back_exactly(tiny_checkpoints, tmp_path, operator_set):
    """export-hf's reader: the graph's code-book weights back as the passes left them."""
    recipe = Recipe(model=str(tiny_checkpoints["qwen2"]),
                    passes=[{"rtn": {"format": "nf4", "group_size": 32, "include_lm_head": True}}],
                    target={"operator_set": operator_set}, quality={"measure": False},
                    runtime={"block_size": 4, "max_context": 64, "max_num_seqs": 2})
    compile_recipe(recipe, tmp_path / "artifact", log=lambda _: None)
    ir, _ = run_passes(load_checkpoint(recipe.model), recipe, log=lambda _: None)
    back = read_artifact(tmp_path / "artifact")
    assert back.quantized.keys() == ir.quantized.keys()
    for name, q in ir.quantized.items():
        r = back.quantized[name]
        assert r.group_size == q.group_size and torch.equal(r.codebook, q.codebook), name
        assert torch.equal(r.codes, q.codes) and torch.equal(r.scales, q.scales), name
