"""ModelIR: copies passes may rewrite, fake quantization kept consistent, and the
source's tokenizer."""

from __future__ import annotations

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.quant_format import group_quantize


def test_copy_leaves_the_original_intact(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    out = ir.copy()
    out.weights["final_norm"] = torch.zeros_like(ir.weights["final_norm"])
    out.annotations["x"] = 1
    assert ir.weights["final_norm"].abs().sum() > 0 and "x" not in ir.annotations


def test_set_quantized_keeps_the_float_weight_equal_to_its_dequantization(tiny_checkpoints):
    ir: ModelIR = load_checkpoint(str(tiny_checkpoints["llama"]))
    q = group_quantize(ir.weights["layers.0.q_proj.weight"], 4, 32, symmetric=True)
    ir.set_quantized("layers.0.q_proj", q)
    torch.testing.assert_close(ir.weights["layers.0.q_proj.weight"], q.dequantize())
    assert ir.quantized["layers.0.q_proj"] is q


def test_the_tied_head_is_the_embedding(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    if ir.arch.tie_word_embeddings:
        assert torch.equal(ir.lm_head(), ir.weights["embed_tokens"])  # read on access
    assert ir.num_parameters() == sum(t.numel() for t in ir.weights.values())


def test_text_token_ids_use_the_sources_tokenizer_without_specials(tiny_checkpoints,
                                                                    tmp_path):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat")
    expected = ir.text_tokenizer().encode("the cat sat on the mat", add_special_tokens=False)
    assert ir.text_token_ids(path) == expected.ids and expected.ids
