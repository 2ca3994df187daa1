"""Write a tiny llama GGUF whose linear tensors are stored in GGUF's quantized block types."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tiny_gguf(path: Path, kinds: dict[str, str], seed: int = 0, ffn: int = 96) -> Path:
    """2 layers, hidden 64, 4 heads / 2 KV heads, byte-level vocabulary of 257; linear
    tensors in the given types (`attn`, `ffn`, `embd`: GGUF type names or F32)."""
    import gguf
    from gguf.quants import quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    hidden, layers, heads, kv_heads = 64, 2, 4, 2
    tokens = [*bytes_to_unicode().values(), "\u0120t"]  # the byte alphabet and one merge
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, shape: tuple[int, ...], kind: str, scale: float = 0.1) -> None:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, w)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), kinds["embd"], 1.0)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
        for name, rows in (("attn_q", hidden), ("attn_k", hidden // 2), ("attn_v", hidden // 2),
                           ("attn_output", hidden)):
            add(f"blk.{i}.{name}.weight", (rows, hidden), kinds["attn"])
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), kinds["ffn"])
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), kinds["ffn"])
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), kinds["ffn"])
    add("output_norm.weight", (hidden,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
