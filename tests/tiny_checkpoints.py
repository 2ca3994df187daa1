"""Tiny random checkpoints of every supported architecture, built with transformers."""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Small enough to build in milliseconds, large enough to exercise GQA (4 heads, 2 KV
# heads), several layers, sliding windows shorter than the test prompts, and every
# RoPE variant.
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(model_type="mistral", sliding_window=12, tie_word_embeddings=False),
    "qwen2": dict(
        model_type="qwen2",
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen3": dict(
        model_type="qwen3",
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    ),
    "gemma2": dict(
        model_type="gemma2", sliding_window=12, query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", sliding_window=12, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
        },
    ),
}


def build_tiny_checkpoint(arch: str, directory: Path, seed: int = 0,
                          overrides: dict | None = None) -> Path:
    """Save a random HF checkpoint + a byte-level tokenizer of `arch` to `directory`
    (`overrides`: config fields to change, e.g. head counts)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**_COMMON, **TINY_CONFIGS[arch], **(overrides or {})}
    config = AutoConfig.for_model(**settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_random_weights(model)
    model.save_pretrained(directory)
    _save_tokenizer(directory, settings["vocab_size"])
    return directory


def _scale_random_weights(model) -> None:
    """Random init gives near-uniform logits and greedy loops on one token; these scales
    give 10-35 distinct tokens in 40 greedy steps for every architecture, so output
    equality tests have teeth. Gemma multiplies embeddings by sqrt(hidden): keep them
    small, or its tied head keeps predicting the input token."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif "embed" in name and model.config.model_type.startswith("gemma"):
                param.normal_(0.0, 0.01)
            elif param.dim() == 2:
                param.normal_(0.0, 0.25)
            else:
                param.normal_(0.0, 0.02)


def _save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over printable bytes, so tests can use text prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    extra = [f"w{i}" for i in range(vocab_size - len(vocab))]
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(extra)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(directory)


# transformers' GGUF loader reads no head_dim for Qwen3 and takes Qwen3Config's 128.
_FAMILY_OVERRIDES: dict[str, dict] = {"qwen3": dict(head_dim=128)}


def build_family_checkpoint(arch: str, directory: Path, seed: int = 0) -> dict[str, Path]:
    """A tiny random checkpoint of `arch` with a tokenizer of its family's real kind, as
    an HF directory ("hf") and as a GGUF file ("gguf") of the same weights."""
    import json

    import torch
    from tiny_gguf import write_gguf
    from tiny_tokenizers import (
        FAMILY_TOKENIZERS,
        generation_config,
        hf_tokenizer,
        train_vocabulary,
    )
    from transformers import AutoConfig, AutoModelForCausalLM

    family = FAMILY_TOKENIZERS[arch]
    vocab = train_vocabulary(family)
    ids = vocab.ids
    settings = {**_COMMON, **TINY_CONFIGS[arch], **_FAMILY_OVERRIDES.get(arch, {}),
                "vocab_size": len(vocab.tokens), "bos_token_id": ids.get(family.bos or ""),
                "eos_token_id": ids[family.eos], "pad_token_id": ids.get(family.pad or "")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings),
                                             dtype=torch.float32)
    _scale_random_weights(model)
    hf_dir = directory / "hf"
    model.save_pretrained(hf_dir)
    hf_tokenizer(family, vocab).save_pretrained(hf_dir)
    (hf_dir / "generation_config.json").write_text(
        json.dumps(generation_config(family, vocab), indent=2))
    gguf_path = write_gguf(hf_dir, family, vocab, directory / f"{arch}.F32.gguf")
    return {"hf": hf_dir, "gguf": gguf_path}
