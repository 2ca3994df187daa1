"""rotate: the rotated model computes the same function, its artifact runs it, and what
the rotation cannot keep equal is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_registry import check_order
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import rotate, rtn
from llmopt.runtime import LLM

TOKENS = list(range(3, 43))


def logits(ir) -> torch.Tensor:
    with torch.no_grad():
        return ReferenceModel(ir).forward(torch.tensor([TOKENS]))[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rotated_model_computes_the_same_logits(arch, tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints[arch]))
    rotated = rotate.run(ir, rotate.Config(), None).ir
    torch.testing.assert_close(logits(rotated), logits(ir), atol=2e-4, rtol=1e-4)
    assert not rotated.arch.tie_word_embeddings
    assert torch.equal(rotated.weights["layers.0.attn_norm"], torch.ones(ir.arch.hidden_size))
    # The basis did change: a reader's weight is not the input's.
    assert not torch.allclose(rotated.weights["layers.0.q_proj.weight"],
                              ir.weights["layers.0.q_proj.weight"])


def test_value_heads_rotate_values_and_not_queries(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["qwen2"]))  # v_proj has a bias
    plain = rotate.run(ir, rotate.Config(value_heads=False), None).ir
    heads = rotate.run(ir, rotate.Config(value_heads=True), None).ir
    for name in ("layers.1.q_proj.weight", "layers.1.k_proj.bias", "layers.1.down_proj.weight"):
        assert torch.equal(plain.weights[name], heads.weights[name])
    for name in ("layers.1.v_proj.weight", "layers.1.v_proj.bias", "layers.1.o_proj.weight"):
        assert not torch.allclose(plain.weights[name], heads.weights[name])
    torch.testing.assert_close(logits(heads), logits(plain), atol=2e-4, rtol=1e-4)


def test_head_row_blocks_equal_the_whole_head(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))  # tied: the head is made here
    rotated = rotate.run(ir, rotate.Config(seed=3), None).ir
    blocks = torch.cat([b for _, b in rotated.weights.row_blocks("lm_head.weight", 50)])
    torch.testing.assert_close(blocks, rotated.weights["lm_head.weight"])


def test_seed_makes_the_rotation(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    one, again, other = (rotate.run(ir, rotate.Config(seed=s), None).ir for s in (1, 1, 2))
    name = "layers.2.gate_proj.weight"
    assert torch.equal(one.weights[name], again.weights[name])
    assert not torch.allclose(one.weights[name], other.weights[name])


def test_artifact_runs_the_rotated_quantized_model(tiny_checkpoints, word_text, tmp_path):
    options = {"bits": 4, "group_size": 32, "include_lm_head": True, "lm_head_bits": 8}
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    passes=[{"rotate": {}}, {"rtn": options}],
                    quality={"eval_text": str(word_text), "eval_windows": 2, "eval_seq_len": 64},
                    runtime={"block_size": 4, "max_context": 128})
    manifest = compile_recipe(recipe, tmp_path / "a", log=lambda _: None)
    assert [p["name"] for p in manifest.passes] == ["rotate", "rtn"]
    assert manifest.passes[0]["untied_head"]
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    rotated = rotate.run(ir, rotate.Config(), None).ir
    quantized = rtn.run(rotated, rtn.Config(**options), None).ir
    expected = torch.log_softmax(logits(quantized)[:-1], -1)[torch.arange(39),
                                                             torch.tensor(TOKENS[1:])]
    np.testing.assert_allclose(LLM(tmp_path / "a").score(TOKENS), expected.numpy(), atol=1e-4)


def test_sandwich_norms_are_refused(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["gemma2"]))
    with pytest.raises(ValueError, match="sandwich norms"):
        rotate.run(ir, rotate.Config(), None)


def test_quantized_weights_are_refused(tiny_checkpoints):
    ir = load_checkpoint(str(tiny_checkpoints["llama"]))
    quantized = rtn.run(ir, rtn.Config(bits=4, group_size=32), None).ir
    with pytest.raises(ValueError, match="already quantized"):
        rotate.run(quantized, rotate.Config(), None)


def test_rotate_comes_before_the_weight_pass():
    check_order(["rotate", "gptq", "kv_cache"])
    with pytest.raises(ValueError, match="'rotate' must come before 'awq'"):
        check_order(["awq", "rotate"])
