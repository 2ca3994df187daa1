"""load_checkpoint: tiny HF checkpoints of every family map exactly onto ModelIR."""

from __future__ import annotations

import math

import pytest
import torch

from llmopt.compiler.architectures import UnsupportedModelError
from llmopt.compiler.loader import CheckpointNotFoundError, load_checkpoint

# Per-layer attention of the tiny configs in tests/conftest.py: (sliding window, rope key).
EXPECTED_LAYERS = {
    "llama": [(None, "global")] * 3,
    "mistral": [(12, "global")] * 3,
    "qwen2": [(None, "global")] * 3,
    "qwen3": [(None, "global")] * 3,
    "gemma2": [(12, "global"), (None, "global"), (12, "global")],
    "gemma3_text": [
        (12, "sliding_attention"), (None, "full_attention"), (12, "sliding_attention")
    ],
}
EXPECTED_ROPE_TYPES = {
    "llama": {"global": "llama3"},
    "mistral": {"global": "default"},
    "qwen2": {"global": "yarn"},
    "qwen3": {"global": "linear"},
    "gemma2": {"global": "default"},
    "gemma3_text": {"sliding_attention": "default", "full_attention": "linear"},
}
GEMMA = ("gemma2", "gemma3_text")


def test_layers_heads_and_windows(arch, ir):
    layers = ir.arch.layers
    assert [(s.num_heads, s.num_kv_heads, s.head_dim) for s in layers] == [(4, 2, 16)] * 3
    assert [(s.sliding_window, s.rope) for s in layers] == EXPECTED_LAYERS[arch]
    assert all(s.kv_dtype == "float32" for s in layers)


def test_scalars(arch, ir):
    spec = ir.arch
    gemma = arch in GEMMA
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size) == (256, 64, 128)
    assert spec.attn_scale == pytest.approx((24 if gemma else 16) ** -0.5)
    assert spec.embedding_scale == (pytest.approx(math.sqrt(64)) if gemma else None)
    assert spec.activation == ("gelu_tanh" if gemma else "silu")
    assert spec.sandwich_norm == gemma
    assert spec.qk_norm == (arch in ("qwen3", "gemma3_text"))
    softcaps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    assert (spec.attn_softcap, spec.final_softcap) == softcaps
    assert (spec.bos_token_id, spec.eos_token_ids, spec.pad_token_id) == (1, (2,), 0)


def test_rope_tables_match_transformers(arch, ir, hf_model):
    assert {k: r.rope_type for k, r in ir.arch.ropes.items()} == EXPECTED_ROPE_TYPES[arch]
    positions = torch.arange(200)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for key, rope in ir.arch.ropes.items():
        extra = () if key == "global" else (key,)  # Gemma 3: one table per layer type
        hf_cos, hf_sin = hf_model.model.rotary_emb(x, positions, *extra)
        cos, sin = rope.tables(200)
        half = ir.arch.layers[0].head_dim // 2
        torch.testing.assert_close(cos, hf_cos[0, :, :half], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin[0, :, :half], rtol=0, atol=1e-6)


def test_every_weight_is_mapped(arch, ir, hf_model):
    """IR weights are HF's, renamed; Gemma norms hold 1 + w; a tied head is dropped."""
    hf = hf_model.state_dict()
    norm_offset = 1.0 if arch in GEMMA else 0.0
    norms = {  # HF suffix -> IR name; these hold 1 + w in Gemma
        "model.norm.weight": "final_norm",
        "input_layernorm.weight": "attn_norm",
        "post_attention_layernorm.weight": "post_attn_norm" if arch in GEMMA else "mlp_norm",
        "pre_feedforward_layernorm.weight": "mlp_norm",
        "post_feedforward_layernorm.weight": "post_mlp_norm",
        "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    }
    expected = {"embed_tokens": hf["model.embed_tokens.weight"]}
    if not ir.arch.tie_word_embeddings:
        expected["lm_head.weight"] = hf["lm_head.weight"]
    for hf_name, tensor in hf.items():
        layer, _, suffix = hf_name.removeprefix("model.layers.").partition(".")
        if hf_name in norms:
            expected[norms[hf_name]] = tensor + norm_offset
        elif suffix in norms:
            expected[f"layers.{layer}.{norms[suffix]}"] = tensor + norm_offset
        elif hf_name.startswith("model.layers."):  # drop "self_attn." / "mlp."
            expected[f"layers.{layer}.{suffix.split('.', 1)[1]}"] = tensor
    assert sorted(ir.weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ir.weights[name], tensor), name


def test_gemma_norm_offset_is_folded(load_ir, tiny_checkpoints):
    """Gemma stores w and multiplies by 1 + w; the IR holds 1 + w (read from the file)."""
    from safetensors.torch import load_file

    ir = load_ir("gemma3_text")
    hf = load_file(tiny_checkpoints["gemma3_text"] / "model.safetensors")
    pairs = {
        "final_norm": "model.norm.weight",
        "layers.2.k_norm": "model.layers.2.self_attn.k_norm.weight",
        "layers.1.post_mlp_norm": "model.layers.1.post_feedforward_layernorm.weight",
    }
    for ir_name, hf_name in pairs.items():
        assert torch.equal(ir.weights[ir_name], hf[hf_name] + 1), ir_name


def test_tied_embeddings(arch, ir, hf_model):
    tied = arch in ("llama", "qwen3", *GEMMA)
    assert ir.arch.tie_word_embeddings == tied
    assert ("lm_head.weight" in ir.weights) == (not tied)
    if tied:
        assert torch.equal(ir.lm_head(), ir.weights["embed_tokens"])  # read on access
    else:
        assert not torch.equal(ir.lm_head(), ir.weights["embed_tokens"])
    assert torch.equal(ir.lm_head(), hf_model.get_output_embeddings().weight)


def test_tokenizer_travels_with_the_ir(ir):
    assert b'"<s>"' in ir.tokenizer_files["tokenizer.json"]
    assert ir.chat_template and "add_generation_prompt" in ir.chat_template
    assert ir.annotations["tokens"] == {"bos_token": "<s>", "eos_token": "</s>"}


TINY_LLAMA = dict(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
)


@pytest.mark.parametrize(
    "settings",
    [
        dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64),
        dict(model_type="phi", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=1, num_attention_heads=2),
    ],
    ids=["gpt2", "phi"],
)
def test_unsupported_architecture_is_named(save_checkpoint, settings):
    path = save_checkpoint(settings)
    name = settings["model_type"]
    with pytest.raises(UnsupportedModelError, match=f"unsupported architecture '{name}'"):
        load_checkpoint(str(path))


def test_architecture_unknown_to_transformers_is_unsupported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "frobnicator"}')
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'frobnicator'"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
             long_factor=[2.0] * 8, original_max_position_embeddings=64),
    ],
    ids=["dynamic", "longrope"],
)
def test_unsupported_rope_type_is_named(save_checkpoint, rope):
    path = save_checkpoint({**TINY_LLAMA, "rope_parameters": rope})
    with pytest.raises(UnsupportedModelError, match=f"RoPE type '{rope['rope_type']}'"):
        load_checkpoint(str(path))


def test_unsupported_feature_flag_is_named(save_checkpoint):
    settings = {
        **TINY_LLAMA, "model_type": "gemma3_text", "query_pre_attn_scalar": 16,
        "use_bidirectional_attention": True,
    }
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        load_checkpoint(str(save_checkpoint(settings)))


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        load_checkpoint(str(tmp_path / "no-such-model"))
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        load_checkpoint(str(tmp_path / "model.Q4_K_M.gguf"))


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match="no config.json"):
        load_checkpoint(str(tmp_path))
