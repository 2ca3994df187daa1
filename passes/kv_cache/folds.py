"""The kv_cache pass's exact folds into the weights: the value rotation (QuaRot) and key
smoothing (QServe's SmoothAttention). Both leave the float model's outputs unchanged."""

from __future__ import annotations

import dataclasses

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.kv_cache_format import hadamard


def rotate_values(ir: ModelIR, layers: list[int]) -> None:
    """v' = H v per KV head (v_proj rows, bias) and o_proj's columns times H: exact."""
    for i in layers:
        _rotate_layer_values(ir, i)


def _rotate_layer_values(ir: ModelIR, i: int) -> None:
    """One layer's fold: its weights are read and released here, one layer at a time."""
    spec = ir.arch.layers[i]
    h = torch.from_numpy(hadamard(spec.head_dim))
    w = ir.weights[f"layers.{i}.v_proj.weight"]
    heads = w.reshape(spec.num_kv_heads, spec.head_dim, -1)
    ir.weights[f"layers.{i}.v_proj.weight"] = (h @ heads).reshape(w.shape)
    if f"layers.{i}.v_proj.bias" in ir.weights:
        b = ir.weights[f"layers.{i}.v_proj.bias"].reshape(spec.num_kv_heads, -1)
        ir.weights[f"layers.{i}.v_proj.bias"] = (b @ h).flatten()  # h is symmetric
    o = ir.weights[f"layers.{i}.o_proj.weight"]
    cols = o.reshape(o.shape[0], spec.num_heads, spec.head_dim)
    ir.weights[f"layers.{i}.o_proj.weight"] = (cols @ h).reshape(o.shape)


def smooth_keys(ir: ModelIR, stats: list[dict[str, torch.Tensor]], alpha: float,
                layers: list[int]) -> None:
    """Divide keys by λ = amax^α per channel (shared by each rotary pair), multiply queries."""
    for i in layers:
        spec = ir.arch.layers[i]
        amax = stats[i]["key"].reshape(spec.num_kv_heads, 2, spec.head_dim // 2)
        pair = amax.amax(1, keepdim=True).expand(-1, 2, -1).reshape(spec.num_kv_heads, -1)
        if ir.arch.qk_norm:  # one norm weight serves every head: one λ for all heads
            pair = pair.amax(0, keepdim=True)
        lam = pair.clamp(min=1e-4) ** alpha
        lam = lam / lam.mean()  # keep magnitudes where they were on average
        groups = spec.num_heads // spec.num_kv_heads
        q_lam = lam.repeat_interleave(groups if lam.shape[0] > 1 else 1, dim=0)
        if ir.arch.qk_norm:
            _scale_vector(ir, f"layers.{i}.q_norm", lam[0])
            _scale_vector(ir, f"layers.{i}.k_norm", 1 / lam[0])
        else:
            _scale_rows(ir, f"layers.{i}.q_proj", q_lam.flatten())
            _scale_rows(ir, f"layers.{i}.k_proj", 1 / lam.flatten())


def _scale_vector(ir: ModelIR, name: str, factor: torch.Tensor) -> None:
    ir.weights[name] = ir.weights[name] * factor


def _scale_rows(ir: ModelIR, linear: str, factor: torch.Tensor) -> None:
    """Multiply output rows of a linear (weight, bias, and integer weights' scales)."""
    if f"{linear}.bias" in ir.weights:
        ir.weights[f"{linear}.bias"] = ir.weights[f"{linear}.bias"] * factor
    if linear in ir.quantized:  # w = (codes - zeros) * scales: scaling a row scales its scales
        q = ir.quantized[linear]
        ir.set_quantized(linear, dataclasses.replace(q, scales=q.scales * factor[:, None]))
    else:
        ir.weights[f"{linear}.weight"] = ir.weights[f"{linear}.weight"] * factor[:, None]
