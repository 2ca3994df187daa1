"""The artifact manifest: the small ABI the runtime reads, and nothing else.

The compiler writes it (`llmopt.compiler.artifact`), the runtime validates it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.runtime.contract import FORMAT_VERSION
from llmopt.runtime.tokenizer_spec import TokenizerSpec

MANIFEST_FILE = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CacheTensor(_Strict):
    """One pool tensor of one layer, indexed by slot on its leading axes."""

    name: str  # "key", "value", "key_scale", "key_min", ... (see compiler/kv_cache_format)
    dtype: str  # numpy dtype name: float32, float16, int8, uint8 (int4 pairs, fp8 bits)
    slot_shape: list[int]  # shape of one slot's entry, e.g. [kv_heads * head_dim]
    # "slot": one entry per token slot; "block": one entry per block (per-block key scales:
    # the block's codes and scales, written whole; see contract)
    per: Literal["slot", "block"] = "slot"


class CacheLayer(_Strict):
    tensors: list[CacheTensor]
    # Tensors kept unrounded for each sequence's first `KVCacheSpec.sink_tokens` positions
    # (float32, in a per-sequence sink store beside the pool; see contract). Empty: none.
    sink: list[CacheTensor] = Field(default_factory=list)
    # Tensors kept unrounded for the block each sequence is filling (per-block scales;
    # float32, in a tail store beside the pool; see contract). Empty: none.
    tail: list[CacheTensor] = Field(default_factory=list)
    window: int | None = Field(None, gt=0)  # the layer's sliding window, if any
    # Whether the layer reads `local_block_tables` (blocks layout; see contract): its pools
    # are the local group's, whose blocks behind the window the runtime frees.
    local: bool = False


class KVCacheSpec(_Strict):
    # "blocks": pool tensors [num_blocks, block_size, *slot_shape], gathered per step;
    # "lanes": [lanes, kv_heads, lane tokens, head_dim], read in place (see contract).
    layout: Literal["blocks", "lanes"] = "blocks"
    layers: list[CacheLayer]
    sink_tokens: int = Field(0, ge=0)  # positions each layer's `sink` tensors keep
    # The block size the graph was built for (per-block tensors); None: any.
    block_size: int | None = Field(None, gt=0)

    def local_window(self) -> int | None:
        """The widest window of the layers that read the local block table (None: none)."""
        return max((layer.window for layer in self.layers if layer.local and layer.window),
                   default=None)

    def bytes_per_sequence(self, context: int, block_size: int) -> dict[str, int]:
        """Pool bytes one sequence of `context` tokens holds while it decodes, by layer
        group: "full" (whole blocks of every position) and "sliding" (the layers that read
        the local table: the blocks their window reaches, the rest freed)."""
        blocks = -(-context // block_size)
        held = {"full": 0, "sliding": 0}
        for layer in self.layers:
            per_block = layer_bytes_per_token(layer, self.block_size) * block_size
            if layer.local and layer.window:
                window_blocks = min(blocks, -(-layer.window // block_size) + 1)
                held["sliding"] += round(per_block * window_blocks)
            else:
                held["full"] += round(per_block * blocks)
        return held

    def sink_bytes_per_sequence(self) -> int:
        """Sink-store bytes one sequence (one distinct first block) takes."""
        return int(self.sink_tokens * sum(layer_bytes_per_token(CacheLayer(tensors=layer.sink))
                                          for layer in self.layers))

    def tail_bytes_per_sequence(self) -> int:
        """Tail-store bytes one sequence's filling block takes (per-block key scales)."""
        return int((self.block_size or 0) * sum(
            layer_bytes_per_token(CacheLayer(tensors=layer.tail)) for layer in self.layers))

    def bytes_per_token(self) -> int:
        """Pool bytes one token takes, codes and scales of every layer included."""
        total = sum(layer_bytes_per_token(layer, self.block_size) for layer in self.layers)
        return round(total) if float(total).is_integer() else total

    def sequences_in_pool(self, pool_bytes: float, context: int, block_size: int) -> int:
        """Sequences of `context` tokens a pool of `pool_bytes` holds (whole blocks each)."""
        num_blocks = int(pool_bytes // (self.bytes_per_token() * block_size)) - 1  # null block
        return max(num_blocks, 0) // -(-context // block_size)


def layer_bytes_per_token(layer: CacheLayer, block_size: int | None = None) -> float:
    """Pool bytes one token takes in this layer; a per-block entry counts 1/block_size."""
    import numpy as np

    def size(t: CacheTensor) -> int:
        return int(np.prod(t.slot_shape)) * np.dtype(t.dtype).itemsize

    return sum(size(t) / (block_size if t.per == "block" else 1) for t in layer.tensors)


class GraphSpec(_Strict):
    file: str  # ONNX file, relative to the artifact directory
    data_file: str | None = None  # external weights file, if any
    opset: int
    operator_set: str  # "onnxruntime" (contrib ops allowed) or "standard"
    nodes: int | None = None  # graph nodes before ONNX Runtime's own fusions
    nodes_per_layer: int | None = None
    # MatMulNBits accuracy: 0 = float32 activations (exact), 4 = int8 activations.
    nbits_accuracy_level: int = 0
    # Where the native step finds each weight (compiler/native_plan.py), or
    # {"unsupported": reason}; None in artifacts compiled before it existed.
    native: dict[str, Any] | None = None


class ModelSpec(_Strict):
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_position: int  # positions the graph's rotary tables cover
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None = None


class StreamingDefaults(_Strict):
    """Attention sinks + a window (runtime/kv/streaming.py): generation past the context."""

    sinks: int = Field(4, ge=0)
    window: int = Field(gt=0)
    drop: int | None = Field(None, gt=0)  # positions dropped at once (None: the runtime's)

    @model_validator(mode="after")
    def _sinks_below_window(self) -> StreamingDefaults:
        if self.sinks >= self.window:
            raise ValueError(f"sinks {self.sinks} must be below the window {self.window}")
        return self


class H2ODefaults(_Strict):
    """H2O (runtime/kv/h2o.py): heavy hitters by accumulated attention plus a recent window."""

    budget: int = Field(gt=0)
    recent: int | None = Field(None, gt=0)  # None: half the budget
    sinks: int = Field(0, ge=0)
    drop: int | None = Field(None, gt=0)  # entries evicted at once (None: the runtime's)

    @model_validator(mode="after")
    def _room_for_heavy_hitters(self) -> H2ODefaults:
        recent = self.budget // 2 if self.recent is None else self.recent
        if recent + self.sinks >= self.budget:
            raise ValueError(f"the budget {self.budget} must exceed the recent window {recent} "
                             f"plus {self.sinks} sinks")
        return self


class RuntimeDefaults(_Strict):
    """What the runtime starts with: a recipe's `runtime:` section, kept in the manifest."""

    block_size: int = Field(16, gt=0)
    max_context: int = Field(2048, gt=0)
    max_num_seqs: int = Field(16, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)  # per-step token budget: chunked prefill
    num_blocks: int | None = Field(None, gt=0)  # None: enough for max_num_seqs * max_context
    streaming: StreamingDefaults | None = None  # None: every request keeps all its KV
    h2o: H2ODefaults | None = None  # None: no heavy-hitter eviction

    @model_validator(mode="after")
    def _streaming_fits(self) -> RuntimeDefaults:
        if self.streaming and self.streaming.sinks + self.streaming.window > self.max_context:
            raise ValueError(f"streaming: sinks + window = "
                             f"{self.streaming.sinks + self.streaming.window} is larger than "
                             f"max_context {self.max_context}")
        if self.h2o and self.h2o.budget > self.max_context:
            raise ValueError(f"h2o: the budget {self.h2o.budget} is larger than max_context "
                             f"{self.max_context}")
        if self.h2o and self.streaming:
            raise ValueError("runtime: choose one of streaming and h2o")
        return self


class NgramDraftSpec(_Strict):
    """N-gram drafting: no model. `latest` (prompt lookup): the longest suffix of a
    sequence's tokens (max_n down to min_n) that occurred earlier in it proposes the
    tokens that followed its latest occurrence. `suffix`: follower counts over the
    sequence and the optional `corpus` decide each token and how far to draft
    (`runtime/speculative/suffix.py`)."""

    min_n: int = 1
    max_n: int = 4
    method: Literal["latest", "suffix"] = "latest"
    min_confidence: float = 0.3  # suffix: stop below this product of follower frequencies
    length_per_match: float = 1.0  # suffix: drafts per token of matched context
    corpus: str | None = None  # suffix: .npy of int64 target token ids, in the artifact


class DraftModelSpec(_Strict):
    """A small model compiled into the artifact beside the target, with its own KV pool.

    It shares the target's block tables (same block ids and block size, its own pool
    tensors), reads target token ids (the compiler re-indexed its embedding) and returns
    logits over `vocab_size` rows; `token_map` maps row j to target token id (None: the
    identity, the vocabularies are the same).
    """

    kind: Literal["model", "self", "tiny"]
    graph: str = "draft"  # key in Manifest.graphs
    kv_cache: KVCacheSpec
    vocab_size: int
    max_position: int
    token_map: str | None = None  # .npy file of int64 [vocab_size], relative to the artifact


class SpeculativeSpec(_Strict):
    """How the runtime speculates: the draft(s), γ, and where it stops paying.

    With both an n-gram and a model draft, a sequence uses the n-gram proposal when its
    lookup matches and the model otherwise.
    """

    gamma: int  # draft tokens per step and sequence
    ngram: NgramDraftSpec | None = None
    model: DraftModelSpec | None = None
    max_batch_size: int = 1  # speculation is switched off when more sequences decode
    # Compile-time measurements, for people and `llmopt inspect`:
    acceptance: list[float] = Field(default_factory=list)  # α at each draft position
    cost_ratio: float | None = None  # draft step / target step, batch 1
    # verify_cost[k]: the target's (k+1)-token step over its 1-token step, batch 1,
    # k = 0..γ at least; with it the runtime sizes each sequence's drafts to what pays.
    verify_cost: list[float] = Field(default_factory=list)
    predicted_speedup: float | None = None
    measured: dict[str, Any] = Field(default_factory=dict)


class Manifest(_Strict):
    format_version: int = FORMAT_VERSION
    model: ModelSpec
    graphs: dict[str, GraphSpec]  # "target", later "draft"
    kv_cache: KVCacheSpec
    runtime: RuntimeDefaults
    tokenizer: TokenizerSpec
    generation: dict[str, Any] = Field(default_factory=dict)  # default sampling params
    speculative: SpeculativeSpec | None = None
    files: dict[str, str] = Field(default_factory=dict)  # relative path -> sha256
    # Compiler-side records: for people and `llmopt inspect`, never read by the runtime loop.
    ir: dict[str, Any] = Field(default_factory=dict)
    recipe: dict[str, Any] = Field(default_factory=dict)
    passes: list[dict[str, Any]] = Field(default_factory=list)
    tools: dict[str, str] = Field(default_factory=dict)

    def runnable_graphs(self) -> list[RunnableGraph]:
        """Every graph the runtime runs, with what this manifest states about it: the
        target, then a draft model where the artifact has one."""
        model = self.model
        graphs = [RunnableGraph("target", self.kv_cache, model.num_layers, model.vocab_size,
                                model.max_position, (), "model", "model.num_layers",
                                "kv_cache")]
        draft = self.speculative.model if self.speculative else None
        if draft is not None:
            graphs.append(RunnableGraph(
                draft.graph, draft.kv_cache, len(draft.kv_cache.layers), draft.vocab_size,
                draft.max_position, (draft.token_map,) if draft.token_map else (),
                "speculative.model", "speculative.model.kv_cache.layers",
                "speculative.model.kv_cache"))
        return graphs


@dataclass(frozen=True)
class RunnableGraph:
    """A graph the runtime runs and what the manifest states about it, with where it
    states it (for messages)."""

    name: str  # key in Manifest.graphs
    kv_cache: KVCacheSpec
    num_layers: int
    vocab_size: int
    max_position: int
    side_files: tuple[str, ...]  # other files the runtime reads for it
    section: str  # where vocab_size and max_position are stated
    layers_field: str
    kv_field: str
