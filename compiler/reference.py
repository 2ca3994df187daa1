"""A small torch decoder over ModelIR: the numerical reference and the calibration model.

Everything it needs is in the IR; it never touches transformers. It holds no weights of
its own: each is read from `ir.weights` by name when used, or once per layer inside
`holding_layer` (what `run_layers` and calibration do), so a forward over many windows
reads each layer once and never has the whole model in float32 at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmopt.compiler.ir import ArchSpec, LayerSpec, ModelIR
from llmopt.compiler.kv_cache_format import (
    KVSide,
    block_round_trip,
    fake_quantize,
    half_precision_attention,
    kv_sides,
    rotate_heads,
)
from llmopt.compiler.weight_store import rows_per_block


@dataclass
class KVCache:
    """Contiguous per-layer keys/values, [batch, kv_heads, tokens, head_dim]."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


# The linears `linear` computes; `stream_linears` reads these a block of rows at a time.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ReferenceModel:
    """Runs ModelIR in float32 torch.

    With `stream_linears`, the linears, the embedding and the LM head are never held: each is
    read a block of rows at a time as it is applied (`WeightStore.row_blocks`), so a forward
    over a few tokens reads each weight once in its stored form (bf16, integer codes)
    instead of writing and reading back a float32 copy of it."""

    def __init__(self, ir: ModelIR, max_position: int | None = None,
                 stream_linears: bool = False):
        self.ir = ir
        self.stream_linears = stream_linears
        self.arch = ir.arch
        # Called with (layer index, linear name, input) before every decoder linear.
        self.observer: Callable[[int, str, torch.Tensor], None] | None = None
        # Called with (layer index, q, k, v) after RoPE (and the key rotation), before the KV
        # cache stores k and v.
        self.kv_observer: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = (
            None)
        positions = max_position or self.arch.max_position
        self.rope_tables = {name: r.tables(positions) for name, r in self.arch.ropes.items()}
        self._held: dict[str, torch.Tensor] = {}  # weights read once for a scope (holding)
        # The decoder linears' matmul dtype inside `holding_layer` (calibration's precision):
        # their weights are held in it and their inputs cast to it; the products sum in
        # float32 and come back float32, through the dtype's rounding.
        self.matmul_dtype = torch.float32

    @contextmanager
    def holding(self, names: Iterable[str], lowered: Collection[str] = ()) -> Iterator[None]:
        """Read the weights `names` once and use them inside the block; released after.
        Those in `lowered` are held in `matmul_dtype`."""
        previous = self._held
        self._held = {**previous, **{n: self._read(n, n in lowered) for n in names
                                     if n in self.ir.weights}}
        try:
            yield
        finally:
            self._held = previous

    def _read(self, name: str, lowered: bool) -> torch.Tensor:
        weight = self.ir.weights[name]
        return weight.to(self.matmul_dtype) if lowered else weight

    def holding_layer(self, index: int):
        """`holding` every weight of decoder layer `index` (but the streamed linears), the
        linears in `matmul_dtype`."""
        prefix = f"layers.{index}."
        linears = {f"{prefix}{name}.weight" for name in LINEARS}
        streamed = linears if self.stream_linears else set()
        return self.holding([n for n in self.ir.weights
                             if n.startswith(prefix) and n not in streamed], linears)

    def holding_head(self):
        """`holding` the final norm and the LM head (the tied embedding when tied)."""
        return self.holding(["final_norm"] + ([] if self.stream_linears else [self.head_name()]))

    def holding_embedding(self):
        """`holding` the embedding table (nothing when streamed: `embed` reads its rows)."""
        return self.holding([] if self.stream_linears else ["embed_tokens"])

    def head_name(self) -> str:
        return self.ir.weight_name("lm_head")

    def weight(self, name: str) -> torch.Tensor:
        held = self._held.get(name)
        return held if held is not None else self.ir.weights[name]

    def weight_or_none(self, name: str) -> torch.Tensor | None:
        held = self._held.get(name)
        return held if held is not None else self.ir.weights.get(name)

    @torch.no_grad()
    def run_layers(self, hidden: list[torch.Tensor], positions: torch.Tensor, start: int = 0,
                   stop: int | None = None) -> list[torch.Tensor]:
        """Each of `hidden` ([batch, seq, hidden] entering layer `start`) through layers
        start..stop, layer-major: each layer's weights are read once for all of them, and
        each tensor is computed exactly as a per-tensor forward would (streamed: as one
        batch, so each linear is streamed once; `hidden` then share a shape)."""
        if self.stream_linears and len(hidden) > 1:
            batch = self.run_layers([torch.cat(hidden)], positions, start, stop)[0]
            return list(batch.split([h.shape[0] for h in hidden]))
        for index in range(start, self.arch.num_layers if stop is None else stop):
            with self.holding_layer(index):
                hidden = [self.layer_forward(index, h, positions, None) for h in hidden]
        return hidden

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, all_logits: bool = True
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] (or [batch, vocab] for the last position)."""
        start = cache.length() if cache is not None else 0
        positions = torch.arange(start, start + input_ids.shape[1])
        hidden = self.embed(input_ids)
        for index in range(self.arch.num_layers):
            hidden = self.layer_forward(index, hidden, positions, cache)
        if not all_logits:
            hidden = hidden[:, -1]
        return self.logits(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._streamed("embed_tokens"):
            hidden = self._streamed_rows("embed_tokens", input_ids)
        else:
            hidden = F.embedding(input_ids, self.weight("embed_tokens"))
        if self.arch.embedding_scale is not None:
            hidden = hidden * torch.tensor(self.arch.embedding_scale, dtype=hidden.dtype)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = rms_norm(hidden, self.weight("final_norm"), self.arch.norm_eps)
        head = self.head_name()
        if self._streamed(head):
            logits = self._streamed_linear(head, hidden)
        else:
            logits = hidden @ self.weight(head).T
        if self.arch.final_softcap:
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return logits

    def layer_forward(
        self, index: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        w = self._layer_weights(index)
        attn_in = rms_norm(hidden, w["attn_norm"], self.arch.norm_eps)
        attn = self.attention(index, attn_in, positions, cache)
        if self.arch.sandwich_norm:
            attn = rms_norm(attn, w["post_attn_norm"], self.arch.norm_eps)
        hidden = hidden + attn
        mlp = self.mlp(index, rms_norm(hidden, w["mlp_norm"], self.arch.norm_eps))
        if self.arch.sandwich_norm:
            mlp = rms_norm(mlp, w["post_mlp_norm"], self.arch.norm_eps)
        return hidden + mlp

    def attention(
        self, index: int, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        spec, w = self.arch.layers[index], self._layer_weights(index)
        batch, seq, _ = x.shape
        q = self.linear(index, x, "q_proj").view(batch, seq, spec.num_heads, spec.head_dim)
        k = self.linear(index, x, "k_proj").view(batch, seq, spec.num_kv_heads, spec.head_dim)
        v = self.linear(index, x, "v_proj").view(batch, seq, spec.num_kv_heads, spec.head_dim)
        if self.arch.qk_norm:
            q = rms_norm(q, w["q_norm"], self.arch.norm_eps)
            k = rms_norm(k, w["k_norm"], self.arch.norm_eps)
        cos, sin = (t[positions] for t in self.rope_tables[spec.rope])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if spec.kv_rotate_keys:
            q, k = rotate_heads(q), rotate_heads(k)
        if self.kv_observer is not None:  # sees the keys the cache stores
            self.kv_observer(index, q, k, v)
        k = self._stored_kv(index, spec, k, positions)
        v = self._stored_kv(index, spec, v, positions, side=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(index, k, v)
        half = half_precision_attention(spec)  # float16 in, float16 out (sums in float32)
        if half:
            q = q.half().float()
        out = self._attend(spec, q, k, v, positions)
        if half:
            out = out.half().float()
        return self.linear(index, out.transpose(1, 2).reshape(batch, seq, -1), "o_proj")

    def _stored_kv(self, index: int, spec: LayerSpec, x: torch.Tensor,
                   positions: torch.Tensor, side: int = 0) -> torch.Tensor:
        """What the KV cache holds for x [batch, seq, kv_heads, head_dim] at `positions`:
        the layer's KV dtype round trip, exactly as the graph stores it (every query reads
        it so), except the sink positions, which are kept as they are."""
        kv_side = kv_sides(spec)[side]
        if spec.kv_dtype == "float32" or kv_side.per_block:  # per block: read in _attend
            return x
        static = self.weight_or_none(f"layers.{index}.{kv_side.static_scale_weight}")
        flat = x.reshape(*x.shape[:2], -1)
        stored = fake_quantize(flat, kv_side, static).reshape(x.shape)
        sink = (positions < spec.kv_sink_tokens)[None, :, None, None]
        return torch.where(sink, x, stored)

    def _attend(
        self, spec: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        q_pos: torch.Tensor,
    ) -> torch.Tensor:
        # The query heads sharing a KV head are stacked as rows of one matmul against it:
        # repeating the keys and values per query head would copy the whole cache a step.
        batch, heads, length, dim = q.shape
        groups = heads // spec.num_kv_heads
        q = q.reshape(batch, spec.num_kv_heads, groups * length, dim)
        k_pos = torch.arange(k.shape[2])
        scores = self._scores(q, k)
        key_side = kv_sides(spec)[0]
        if key_side.per_block:  # keys of earlier blocks through their block's scales
            block = spec.kv_block_size
            earlier = (k_pos[None, :] // block) < (q_pos[:, None] // block)
            read = block_read(k, key_side, block)
            scores = torch.where(earlier.repeat(groups, 1), self._scores(q, read), scores)
        allowed = attention_mask(q_pos, k_pos, spec.sliding_window).repeat(groups, 1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).reshape(batch, heads, length, dim)

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) * self.arch.attn_scale
        if self.arch.attn_softcap:
            scores = torch.tanh(scores / self.arch.attn_softcap) * self.arch.attn_softcap
        return scores

    def mlp(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate = self.linear(index, x, "gate_proj")
        gate = F.silu(gate) if self.arch.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.linear(index, gate * self.linear(index, x, "up_proj"), "down_proj")

    def linear(self, index: int, x: torch.Tensor, name: str) -> torch.Tensor:
        """Layer `index`'s linear `name` on x; calibration observes its input here."""
        if self.observer is not None:
            self.observer(index, name, x)
        w = self._layer_weights(index)
        key, bias = f"layers.{index}.{name}.weight", w.get(f"{name}.bias")
        if not self._streamed(key):
            weight = w[f"{name}.weight"]
            if weight.dtype != x.dtype:  # held lowered (matmul_dtype)
                out = F.linear(x.to(weight.dtype), weight).float()
                return out if bias is None else out + bias
            return F.linear(x, weight, bias)
        out = self._streamed_linear(key, x)
        return out if bias is None else out + bias

    def _streamed(self, name: str) -> bool:
        return self.stream_linears and name not in self._held

    def _streamed_linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x @ Wᵀ with W read a block of rows at a time."""
        blocks = self.ir.weights.row_blocks(name, rows_per_block(x.shape[-1]))
        return torch.cat([F.linear(x, block) for _, block in blocks], dim=-1)

    def _streamed_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight `name`, gathered block by block."""
        out = None
        for start, block in self.ir.weights.row_blocks(name, rows_per_block(self.arch.hidden_size)):
            if out is None:
                out = torch.zeros(*ids.shape, block.shape[1])
            inside = (ids >= start) & (ids < start + block.shape[0])
            out[inside] = block[ids[inside] - start]
        return out

    def _layer_weights(self, index: int) -> _LayerWeights:
        return _LayerWeights(self, f"layers.{index}.")


class _LayerWeights:
    """`w["q_proj.weight"]` is the model's weight "layers.{i}.q_proj.weight"."""

    def __init__(self, model: ReferenceModel, prefix: str):
        self.model, self.prefix = model, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.model.weight(self.prefix + name)

    def get(self, name: str) -> torch.Tensor | None:
        return self.model.weight_or_none(self.prefix + name)


def block_read(k: torch.Tensor, side: KVSide, block_size: int) -> torch.Tensor:
    """Keys [B, kv_heads, T, D] as their blocks' per-channel scales read them back."""
    batch, heads, length, dim = k.shape
    flat = k.transpose(1, 2).reshape(batch, length, heads * dim)
    read = block_round_trip(flat, side, block_size)
    return read.reshape(batch, length, heads, dim).transpose(1, 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half convention; x [batch, seq, heads, dim], cos/sin [seq, dim/2]."""
    cos = torch.cat([cos, cos], dim=-1)[None, :, None, :]
    sin = torch.cat([sin, sin], dim=-1)[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] bool: causal, and within the sliding window when there is one."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


def greedy_generate(model: ReferenceModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with a KV cache; the reference for runtime outputs."""
    cache = KVCache()
    logits = model.forward(torch.tensor([prompt]), cache, all_logits=False)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0].argmax())
        out.append(token)
        logits = model.forward(torch.tensor([[token]]), cache, all_logits=False)
    return out


def spec_summary(arch: ArchSpec) -> str:
    """One line for progress output."""
    heads = {(s.num_heads, s.num_kv_heads) for s in arch.layers}
    return (
        f"{arch.family}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"heads/kv {sorted(heads)}, vocab {arch.vocab_size}"
    )
