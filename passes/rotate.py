"""rotate: turn the residual stream by a random orthogonal matrix before weight quantization.

Recipe: `- rotate: {seed: 0, value_heads: true}`, listed before the weight pass (QuaRot,
SpinQuant). The model computes the same function in float; what changes is the basis the
linears see: a random rotation spreads the residual stream's few outlier channels over all
of them. GPTQ loses much less after it; AWQ about the same; RTN more, as the folded norms
then set its group scales (benchmarks/README.md, `quality_domains.py`).

What it rewrites (row-vector form, x Q is the rotated stream):
- each RMSNorm's weight is folded into the linears reading its output (the norm becomes
  ones: a diagonal scale does not commute with Q), and the final norm into the LM head;
- the embedding becomes E Q, each reader (q/k/v, gate/up) W diag(norm) Q, each writer
  (o_proj, down_proj) Qᵀ W; the LM head diag(final norm) then Q, hence untied from the
  embedding when they were tied (the head then has its own table: the artifact grows by one
  float embedding, reported);
- with `value_heads`, each head's values by a normalized Hadamard matrix H and o_proj's
  inputs by Hᵀ, spreading value outliers over the head (for a KV cache and for o_proj).

The graph is unchanged (norms of ones, an untied head), so every executor runs the result.
Weights are computed from the input's when read, never held whole. Refused: sandwich norms
(Gemma 2/3: a norm between a writer and the residual does not commute with Q) and already
quantized weights (the rotation would float them again).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch
from pydantic import BaseModel, ConfigDict

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.kv_cache_format import hadamard
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.weight_store import RowBlock, WeightStore

READERS = {"attn_norm": ("q_proj", "k_proj", "v_proj"), "mlp_norm": ("gate_proj", "up_proj")}
WRITERS = ("o_proj", "down_proj")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0  # of the random orthogonal matrix: the artifact is reproducible
    value_heads: bool = True  # also a Hadamard rotation of each head's values


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    check_rotatable(ir)
    out = rotate_model(ir, random_orthogonal(ir.arch.hidden_size, config.seed),
                       config.value_heads)
    tied = ir.arch.tie_word_embeddings
    head_bytes = 4 * ir.arch.vocab_size * ir.arch.hidden_size if tied else 0
    if context is not None:
        context.log(f"      rotate: residual stream of width {ir.arch.hidden_size} turned"
                    + (f"; the LM head untied (+{head_bytes / 2**20:.0f} MiB float)" if tied
                       else ""))
    report = {"hidden_size": ir.arch.hidden_size, "seed": config.seed,
              "norms_folded": 2 * ir.arch.num_layers + 1, "untied_head": tied,
              "untied_head_bytes": head_bytes,
              "value_heads_rotated": sum(config.value_heads and _power_of_two(s.head_dim)
                                         for s in ir.arch.layers),
              "seconds": round(time.perf_counter() - started, 3)}
    return PassResult(out, report)


def rotate_model(ir: ModelIR, q: torch.Tensor, value_heads: bool) -> ModelIR:
    """`ir` with its residual stream turned by the orthogonal [hidden, hidden] `q` (and each
    head's values by a Hadamard matrix): the same function, every weight computed when read."""
    out = ir.copy()
    _rotate_ends(ir, out, q)
    for index in range(ir.arch.num_layers):
        _rotate_layer(ir, out, index, q)
        if value_heads and _power_of_two(ir.arch.layers[index].head_dim):
            _rotate_values(out, index)
    out.arch = dataclasses.replace(ir.arch, tie_word_embeddings=False)
    return out


def check_rotatable(ir: ModelIR) -> None:
    """A one-line refusal for a model the rotation cannot keep equal."""
    if ir.arch.sandwich_norm:
        raise ValueError(f"rotate: {ir.arch.family} normalizes each block's output before the "
                         "residual (sandwich norms), which a rotation does not pass through")
    if len(ir.quantized):
        raise ValueError("rotate: the weights are already quantized (a quantized source, or a "
                         "weight pass before it); list rotate before the weight pass")


def random_orthogonal(size: int, seed: int) -> torch.Tensor:
    """A seeded random orthogonal [size, size] matrix (Haar: QR of a Gaussian, signs fixed)."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def _rotate_ends(ir: ModelIR, out: ModelIR, q: torch.Tensor) -> None:
    """The embedding E Q and the head diag(final norm) Q, the final norm ones."""
    w, hidden = ir.weights, ir.arch.hidden_size
    head = ir.weight_name("lm_head")
    final_norm = w["final_norm"]
    _set_rotated_rows(out.weights, "embed_tokens", w, "embed_tokens", q)
    _set_rotated_rows(out.weights, "lm_head.weight", w, head, q, final_norm)
    out.weights["final_norm"] = torch.ones(hidden)


def _rotate_layer(ir: ModelIR, out: ModelIR, index: int, q: torch.Tensor) -> None:
    """Layer `index`'s readers W diag(norm) Q, writers Qᵀ W, its norms ones."""
    w, p = ir.weights, f"layers.{index}."
    for norm, readers in READERS.items():
        weight = w[p + norm]
        for name in readers:
            key = p + name + ".weight"
            _set_rotated_rows(out.weights, key, w, key, q, weight)
        out.weights[p + norm] = torch.ones(ir.arch.hidden_size)
    for name in WRITERS:
        for suffix in (".weight", ".bias"):
            key = p + name + suffix
            if key in w:
                out.weights.set_lazy(key, _left_times(q.T, w, key), w.shape(key))


def _rotate_values(out: ModelIR, index: int) -> None:
    """Each head's value rows H v, o_proj's columns of that head o Hᵀ (H symmetric)."""
    spec, p, store = out.arch.layers[index], f"layers.{index}.", out.weights
    h = torch.from_numpy(hadamard(spec.head_dim))
    before = store.copy()  # the layer's already rotated weights, read through
    for key in (p + "v_proj.weight", p + "v_proj.bias"):
        if key in before:
            store.set_lazy(key, _per_head(before, key, h, spec.head_dim, rows=True),
                           before.shape(key))
    key = p + "o_proj.weight"
    store.set_lazy(key, _per_head(before, key, h, spec.head_dim, rows=False), before.shape(key))


def _set_rotated_rows(store: WeightStore, name: str, source: WeightStore, source_name: str,
                      q: torch.Tensor, norm: torch.Tensor | None = None) -> None:
    """`name` = source[source_name] diag(norm) q, computed when read (and by row blocks);
    only the norm's vector is held, never a folded [hidden, hidden] matrix per layer."""

    def turned(rows: torch.Tensor) -> torch.Tensor:
        return (rows if norm is None else rows * norm) @ q

    def compute() -> torch.Tensor:
        return turned(source[source_name])

    def blocks(rows: int) -> Iterator[RowBlock]:
        for start, block in source.row_blocks(source_name, rows):
            yield start, turned(block)

    store.set_lazy(name, compute, source.shape(source_name), blocks=blocks)


def _left_times(left: torch.Tensor, source: WeightStore, name: str) -> Callable[[], torch.Tensor]:
    return lambda: left @ source[name]


def _per_head(source: WeightStore, name: str, h: torch.Tensor, head_dim: int,
              rows: bool) -> Callable[[], torch.Tensor]:
    """H applied to each head's block of rows (values) or of columns (o_proj's inputs)."""

    def compute() -> torch.Tensor:
        w = source[name]
        if rows:  # [heads * head_dim, ...]: each head's rows H v
            return torch.einsum("ij,hj...->hi...", h, w.reshape(-1, head_dim, *w.shape[1:])
                                ).reshape(w.shape)
        return (w.reshape(w.shape[0], -1, head_dim) @ h.T).reshape(w.shape)

    return compute


def _power_of_two(size: int) -> bool:
    return size > 0 and size & (size - 1) == 0
