"""Write a tiny HF checkpoint as a GGUF file, the way llama.cpp's converter lays it out.

Tensors are renamed with gguf's own name map and stored as F32; Llama-architecture Q/K
rows are permuted and Gemma norms stored as 1 + w, which transformers' GGUF loader undoes.
The metadata holds what transformers reads back for each architecture (its GGUF config
mapping drops RoPE scaling and soft-capping, so the GGUF model is a sibling of the HF
one, not a copy; each is compared with transformers on its own file).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tiny_tokenizers import FamilyTokenizer, Vocabulary, gguf_tokenizer_fields

# model_type -> (GGUF architecture, general.name). llama.cpp writes Mistral as "llama";
# transformers reads such a file as Llama unless general.name is exactly "mistral", and
# then fails to load it (see test_source_tokenizer.py).
GGUF_ARCHS = {
    "llama": ("llama", "tiny-llama"),
    "mistral": ("llama", "Mistral 7B Tiny"),  # as real files name it: read as llama
    "qwen2": ("qwen2", "tiny-qwen2"),
    "qwen3": ("qwen3", "tiny-qwen3"),
    "gemma2": ("gemma2", "tiny-gemma2"),
    "gemma3_text": ("gemma3", "tiny-gemma3"),
}


def write_gguf(checkpoint: Path, family: FamilyTokenizer, vocab: Vocabulary,
               path: Path, name: str | None = None) -> Path:
    """`checkpoint`'s config and weights plus the family tokenizer, as one GGUF file
    (`name`: general.name, else the architecture's usual one)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    arch, usual_name = GGUF_ARCHS[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or usual_name)
    _write_hparams(writer, config)
    gguf_tokenizer_fields(writer, family, vocab)
    names = gguf.get_tensor_name_map(_model_arch(arch), config["num_hidden_layers"])
    for hf_name, tensor in sorted(load_file(checkpoint / "model.safetensors").items()):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        writer.add_tensor(gguf_name, _convert(gguf_name, tensor.astype(np.float32), arch, config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _model_arch(arch: str) -> object:
    import gguf

    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _write_hparams(writer: object, config: dict) -> None:
    head_dim = config["head_dim"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])


def _convert(gguf_name: str, tensor: np.ndarray, arch: str, config: dict) -> np.ndarray:
    if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config["num_attention_heads"]
        if "attn_k" in gguf_name:
            heads = config["num_key_value_heads"]
        return _permute(tensor, heads)
    if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
        return tensor + 1.0
    return tensor


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order: the inverse of transformers' reverse permute."""
    shape = weights.shape
    return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2) \
        .reshape(shape)
