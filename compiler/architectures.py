"""Per-architecture knowledge, as data: how each supported checkpoint maps onto ModelIR.

Algorithms stay generic; everything that differs between families is a row here.
"""

from __future__ import annotations

from dataclasses import dataclass

# HF per-layer parameter suffix -> IR name (after "layers.{i}.").
_ATTN = {
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.bias": "o_proj.bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
_MLP = {
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    "mlp.gate_proj.bias": "gate_proj.bias",
    "mlp.up_proj.bias": "up_proj.bias",
    "mlp.down_proj.bias": "down_proj.bias",
}
_PRE_NORM = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
}
_SANDWICH_NORM = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ArchFamily:
    """What one HF `model_type` needs beyond the fields every config has."""

    layer_names: dict[str, str]
    norm_offset: float = 0.0  # Gemma stores norm weights as w with multiplier 1 + w
    scale_embeddings: bool = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    qk_norm: bool = False
    sandwich_norm: bool = False
    # Config attributes that must be falsy/absent: features this family's code has
    # but llmopt does not implement. Each is named in the error.
    unsupported_flags: tuple[str, ...] = ()


_LLAMA_LIKE = {**_PRE_NORM, **_ATTN, **_MLP}
_GEMMA_LIKE = {**_SANDWICH_NORM, **_ATTN, **_MLP}

FAMILIES: dict[str, ArchFamily] = {
    "llama": ArchFamily(layer_names=_LLAMA_LIKE),
    "mistral": ArchFamily(layer_names=_LLAMA_LIKE),
    "qwen2": ArchFamily(layer_names=_LLAMA_LIKE),
    "qwen3": ArchFamily(layer_names=_LLAMA_LIKE, qk_norm=True),
    "gemma2": ArchFamily(
        layer_names=_GEMMA_LIKE, norm_offset=1.0, scale_embeddings=True, sandwich_norm=True
    ),
    "gemma3_text": ArchFamily(
        layer_names=_GEMMA_LIKE,
        norm_offset=1.0,
        scale_embeddings=True,
        sandwich_norm=True,
        qk_norm=True,
        unsupported_flags=("use_bidirectional_attention",),
    ),
}

# IR names of RMSNorm weights (per layer, and the final norm): where norm_offset applies.
NORM_NAMES = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm")


def is_norm(name: str) -> bool:
    """Is this IR weight a norm's (Gemma stores those as an offset from 1)?"""
    return name == "final_norm" or name.rsplit(".", 1)[-1] in NORM_NAMES

# GGUF tensor names (llama.cpp's converter): GGUF linear -> IR linear, per layer.
GGUF_LAYER_LINEARS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                      "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                      "ffn_down": "down_proj"}
# llama.cpp's converter interleaves the rotary halves of Q and K rows for these
# `general.architecture`s; transformers' GGUF loader undoes it (LlamaTensorProcessor).
GGUF_PERMUTED_QK = {"llama"}


def gguf_names(num_layers: int, tied: bool) -> dict[str, str]:
    """IR linear name -> GGUF tensor name (the tied LM head is the token embedding)."""
    names = {f"layers.{i}.{ir}": f"blk.{i}.{g}.weight"
             for i in range(num_layers) for g, ir in GGUF_LAYER_LINEARS.items()}
    names["lm_head"] = "token_embd.weight" if tied else "output.weight"
    return names


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def family_for(model_type: str) -> ArchFamily:
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature llmopt cannot compile."""
