"""Static KV-cache scales: one per channel, calibrated on the recipe's calibration windows.

`absmax`: the channel's largest magnitude maps to the top code, so nothing clips.
`search` (int8, int4): each channel's scale is the fraction of its absmax (`CLIP_FRACTIONS`)
that minimises the squared rounding error weighted by how much each stored entry matters to
attention: a value entry by the squared attention weights it receives (an output's error is
Σ_j p_j Δv_j), a key entry by how far a score error there moves the attention output
(`attention_weights`). Clipping a channel's rare
large entries buys finer steps for all the others; the weights keep that trade from
sacrificing the positions attention relies on, such as the attention sinks.
`auto` searches for int4 only: int8's 255 levels leave clipping nothing to buy, while
int4's absmax steps are coarse (benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from llmopt.compiler.ir import ArchSpec, LayerSpec, ModelIR
from llmopt.compiler.kv_cache_format import CODE_MAX
from llmopt.compiler.reference import ReferenceModel, attention_mask

CLIP_FRACTIONS = torch.linspace(0.2, 1.0, 33)
CODE_RANGE = {"int8": (-127.0, 127.0), "int4": (-8.0, 7.0)}  # static symmetric codes
SIDES = ("key", "value")
SideStats = dict[str, torch.Tensor]  # "amax" [W], and per searched dtype its errors [F, W]


@torch.no_grad()
def kv_absmax(ir: ModelIR, windows: torch.Tensor, skip_first: int = 0
              ) -> list[dict[str, torch.Tensor]]:
    """Per layer and side: absmax per channel ([W]) of what the cache is given at positions
    from `skip_first` on (the ones before are sinks, kept unrounded)."""
    stats = [{side: torch.zeros(0) for side in SIDES} for _ in ir.arch.layers]

    def observe(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for side, x in zip(SIDES, (k, v), strict=True):
            amax = x[:, skip_first:].abs().flatten(0, 1).amax(0).flatten()
            seen = stats[index][side]
            stats[index][side] = amax if seen.numel() == 0 else torch.maximum(seen, amax)

    _observe(ir, windows, observe)
    return stats


@torch.no_grad()
def kv_scale_statistics(ir: ModelIR, windows: torch.Tensor, dtypes: Iterable[str],
                        skip_first: int = 0) -> list[dict[str, SideStats]]:
    """Per layer and side: the absmax, and for each dtype in `dtypes` (those searched) the
    attention-weighted error of every candidate scale (two passes over the windows), of
    positions from `skip_first` on."""
    amax = kv_absmax(ir, windows, skip_first)
    searched = list(dtypes)
    stats = [{side: {"amax": amax[i][side]} for side in SIDES} for i in range(len(amax))]
    if not searched:
        return stats

    def observe(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        spec = ir.arch.layers[index]
        weights = attention_weights(ir.arch, spec, q, k, v)
        for side, x, w in zip(SIDES, (k, v), weights, strict=True):
            for dtype in searched:
                error = clip_errors(x[:, skip_first:].flatten(2).flatten(0, 1),
                                    w[:, skip_first:].flatten(0, 1),
                                    stats[index][side]["amax"], dtype)
                seen = stats[index][side].get(dtype)
                stats[index][side][dtype] = error if seen is None else seen + error

    _observe(ir, windows, observe)
    return stats


def static_scale(stats: SideStats, dtype: str, method: str) -> torch.Tensor:
    """[W] per-channel scale: the searched clip where asked for and measured, else absmax."""
    amax = stats["amax"].clamp(min=1e-6)
    if searches(method, dtype) and dtype in stats:
        best = stats[dtype].argmin(0)  # ties: the smallest clip, listed first
        return CLIP_FRACTIONS[best] * amax / CODE_MAX[dtype]
    return amax / CODE_MAX[dtype]


def searches(method: str, dtype: str) -> bool:
    """Whether `static_scales: method` searches the clip of `dtype`'s channel scales."""
    return dtype in CODE_RANGE and (method == "search" or (method == "auto" and dtype == "int4"))


def attention_weights(arch: ArchSpec, spec: LayerSpec, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How much each key and value entry matters, [batch, seq, kv_heads * head_dim] each,
    summed over the KV head's query heads: values Σ_i p_ij², keys Σ_i p_ij |v_j - o_i|² q_ic²
    (a score error Δs_ij moves output i by p_ij Δs_ij (v_j - o_i), o_i the attention output)."""
    batch, seq = q.shape[:2]
    group = spec.num_heads // spec.num_kv_heads
    qh = q.transpose(1, 2)  # [B, H, T, D]
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * arch.attn_scale
    if arch.attn_softcap:
        scores = torch.tanh(scores / arch.attn_softcap) * arch.attn_softcap
    positions = torch.arange(seq)
    allowed = attention_mask(positions, positions, spec.sliding_window)
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # [B, H, Tq, Tk]
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    out = p @ vh
    spread = ((vh * vh).sum(-1)[:, :, None, :] + (out * out).sum(-1)[:, :, :, None]
              - 2 * out @ vh.transpose(-1, -2))  # |v_j - o_i|², [B, H, Tq, Tk]
    key = torch.einsum("bhij,bhic->bhjc", p * spread, qh * qh)
    value = (p * p).sum(2, keepdim=True).transpose(2, 3).expand(-1, -1, -1, spec.head_dim)

    def per_kv_head(w: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B, T, KH * D]
        w = w.reshape(batch, spec.num_kv_heads, group, seq, spec.head_dim).sum(2)
        return w.transpose(1, 2).reshape(batch, seq, -1)

    return per_kv_head(key), per_kv_head(value)


def clip_errors(x: torch.Tensor, weight: torch.Tensor, amax: torch.Tensor, dtype: str
                ) -> torch.Tensor:
    """[F, W]: Σ_tokens weight · (round-trip − x)² for each candidate scale f · amax / top."""
    low, high = CODE_RANGE[dtype]
    scales = CLIP_FRACTIONS[:, None] * amax.clamp(min=1e-6) / CODE_MAX[dtype]  # [F, W]
    codes = torch.clamp(torch.round(x[None] / scales[:, None]), low, high)
    return (weight[None] * (codes * scales[:, None] - x[None]) ** 2).sum(1)


def _observe(ir: ModelIR, windows: torch.Tensor, observer) -> None:
    """Run every window through the decoder layers, layer-major (each layer's weights read
    once), calling `observer` on what each layer's cache is given."""
    model = ReferenceModel(ir, windows.shape[1])
    model.kv_observer = observer
    with torch.no_grad(), model.holding(["embed_tokens"]):
        hidden = [model.embed(window[None]) for window in windows]
    model.run_layers(hidden, torch.arange(windows.shape[1]))
