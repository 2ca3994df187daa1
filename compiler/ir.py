"""ModelIR: one architecture-neutral description of a decoder-only transformer.

`ArchSpec` holds every shape and numerical convention the reference model and the
lowering need; `ModelIR` adds the named weights and what passes have annotated.
Per-layer fields (heads, KV heads, sliding window, rotary table, KV dtype) live in
`LayerSpec` because passes change them layer by layer.

Weight names (all float tensors, torch layout [out, in] for linears):
  embed_tokens                         [vocab, hidden]
  layers.{i}.attn_norm                 [hidden]      RMSNorm before attention
  layers.{i}.{q,k,v,o}_proj.weight     (+ .bias when the checkpoint has one)
  layers.{i}.{q,k}_norm                [head_dim]    qk-norm (Qwen3, Gemma 3)
  layers.{i}.post_attn_norm            [hidden]      sandwich norm (Gemma 2/3)
  layers.{i}.mlp_norm                  [hidden]      RMSNorm before the MLP
  layers.{i}.{gate,up,down}_proj.weight
  layers.{i}.post_mlp_norm             [hidden]      sandwich norm (Gemma 2/3)
  final_norm                           [hidden]
  lm_head.weight                       [vocab, hidden]  absent when tied to embed_tokens
Norm weights are stored as the effective multiplier (Gemma's `1 + w` is folded at load).

A draft model's `vocab_size` is its logits width: its embedding has one row per TARGET
token id (re-indexed at compile time) and its LM head one row per `DraftBundle.token_map`
entry, so the two may differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from llmopt.compiler.quant_format import QuantizedLinear
from llmopt.compiler.weight_store import QuantizedStore, WeightStore
from llmopt.runtime.tokenizer_spec import TokenizerSpec

Activation = Literal["silu", "gelu_tanh"]
KV_DTYPES = ("float32", "float16", "fp8_e4m3", "int8", "int4")  # see kv_cache_format

if TYPE_CHECKING:
    import tokenizers


@dataclass(frozen=True)
class RopeSpec:
    """A rotary table, resolved at load time so every RoPE variant looks the same.

    cos/sin at position p are cos(p * inv_freq) * attention_factor (float32 math, as HF).
    """

    rope_type: str  # default | linear | llama3 | yarn: for reports only
    inv_freq: tuple[float, ...]  # head_dim // 2 float32 values
    attention_factor: float = 1.0

    def tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [max_position, head_dim // 2], float32."""
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


@dataclass(frozen=True)
class LayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # attend to at most this many previous positions
    rope: str = "global"  # key into ArchSpec.ropes
    kv_dtype: str = "float32"
    # Quantized KV dtypes (the `kv_cache` pass): channels per dynamic per-token scale group
    # of keys (None: one group per head) and of values (None: as keys), and how each side
    # is scaled: "token" (dynamic, computed at write time), "channel" (static, calibrated:
    # `layers.{i}.{key,value}_cache_scale`) or, for keys, "block" (per channel per block).
    kv_group_size: int | None = None
    kv_value_group_size: int | None = None  # values' groups when they differ from keys'
    kv_key_scales: str = "token"
    # Queries and keys multiplied by a normalized Hadamard matrix per head after RoPE (q·k is
    # unchanged): spreads key outliers over all channels before per-token quantization.
    kv_rotate_keys: bool = False
    kv_value_scales: str = "token"
    # The first N positions of every sequence are kept in float32 beside the quantized
    # cache (attention sinks, KVQuant/IntactKV): each query reads them unrounded.
    kv_sink_tokens: int = 0
    # kv_key_scales "block": keys are scaled per channel within each block of this many
    # positions (the runtime's block size, fixed by the artifact); see kv_cache_format.
    kv_block_size: int | None = None


@dataclass(frozen=True)
class ArchSpec:
    family: str  # the checkpoint's model_type, for reports
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float
    activation: Activation
    ropes: dict[str, RopeSpec]
    max_position: int
    tie_word_embeddings: bool
    attn_scale: float  # multiplies q·k before softmax
    embedding_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    attn_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_softcap: float | None = None
    qk_norm: bool = False
    sandwich_norm: bool = False  # post-attention and post-MLP norms (Gemma 2/3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def replace_layer(self, index: int, **changes: Any) -> ArchSpec:
        layers = list(self.layers)
        layers[index] = dataclasses.replace(layers[index], **changes)
        return dataclasses.replace(self, layers=tuple(layers))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ModelIR:
    arch: ArchSpec
    weights: MutableMapping[str, torch.Tensor]  # a WeightStore: read on access
    source: str  # where the checkpoint came from
    tokenizer_files: dict[str, bytes] = field(default_factory=dict)  # name -> content
    # How the runtime tokenizes, as transformers does on the source (the manifest's section).
    tokenizer_spec: TokenizerSpec | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, Any] = field(default_factory=dict)  # pass records
    # Linear name ("layers.0.q_proj", "lm_head") -> its integer weights. The float weight
    # in `weights` is kept equal to their dequantization, so the reference model computes
    # exactly what the quantized graph computes (fake quantization).
    quantized: MutableMapping[str, QuantizedLinear] = field(default_factory=dict)
    draft: DraftBundle | None = None  # set by the `draft` pass; lowered as graph "draft"

    def __setattr__(self, name: str, value: Any) -> None:
        # Weights given as a plain dict (tests, small sources) become the stores passes expect.
        if name == "weights" and not isinstance(value, WeightStore):
            value = WeightStore(overlay=value)
        elif name == "quantized" and not isinstance(value, QuantizedStore):
            value = QuantizedStore(dict(value))
        super().__setattr__(name, value)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer_spec.chat_template if self.tokenizer_spec else None

    @property
    def add_bos_token(self) -> bool:
        return self.tokenizer_spec.add_bos_token if self.tokenizer_spec else False

    def text_tokenizer(self) -> tokenizers.Tokenizer:
        """The source's tokenizer, as the artifact ships it (`tokenizer.json`)."""
        import tokenizers

        return tokenizers.Tokenizer.from_str(self.tokenizer_files["tokenizer.json"].decode())

    def text_token_ids(self, text_file: str | Path) -> list[int]:
        """A UTF-8 text file's token ids without special tokens (the perplexity protocol)."""
        from llmopt.runtime.texts import read_text

        return self.text_tokenizer().encode(read_text(text_file), add_special_tokens=False).ids

    def copy(self) -> ModelIR:
        """A new IR sharing tensors: passes rewrite the copy and leave their input intact."""
        return dataclasses.replace(self, weights=self.weights.copy(),
                                   annotations=dict(self.annotations),
                                   quantized=self.quantized.copy())

    def set_quantized(self, linear: str,
                      q: QuantizedLinear | Callable[[], QuantizedLinear]) -> None:
        """Record `linear`'s integer weights, or a function reading them from a checkpoint on
        each access; its float weight becomes their dequantization, computed when read
        (never a resident float copy)."""
        store = self.quantized
        if isinstance(q, QuantizedLinear):
            store[linear] = q
        else:
            store.defer(linear, q)
        self.weights.set_lazy(self.weight_name(linear), lambda: store[linear].dequantize(),
                              store.shape(linear),
                              blocks=lambda rows: store[linear].row_blocks(rows))

    def weight_name(self, linear: str) -> str:
        """Where a linear's float weight is stored (the LM head may be the tied embedding)."""
        if linear == "lm_head" and self.arch.tie_word_embeddings:
            return "embed_tokens"
        return f"{linear}.weight"

    def lm_head(self) -> torch.Tensor:
        return self.weights[self.weight_name("lm_head")]

    def num_parameters(self) -> int:
        return self.weights.numel()


@dataclass
class DraftBundle:
    """A speculative-decoding draft paired with the target: what the artifact records.

    `ir` is None for an n-gram-only draft. `token_map[j]` is the target token id of the
    draft's logits row j (None: the identity). `speculative` holds the manifest's
    SpeculativeSpec fields other than `model` (gamma, ngram, max_batch_size, acceptance,
    cost_ratio, predicted_speedup, measured).
    """

    kind: Literal["model", "self", "tiny", "ngram"]
    ir: ModelIR | None
    token_map: torch.Tensor | None  # int64 [draft vocab_size]
    speculative: dict[str, Any] = field(default_factory=dict)
    ngram_corpus: list[int] | None = None  # target token ids the suffix n-gram drafter counts
