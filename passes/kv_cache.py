"""KV cache dtype: store each layer's keys and values as float16, bfloat16, fp8 e4m3, int8 or
int4.

Recipe: `- kv_cache: {dtype: int8}`; options:
  group_size     channels per dynamic scale group (divides head_dim; default: one per head)
  value_group_size   values' group size when it differs (default: group_size)
  key_scales     "token": dynamic, computed in the graph at write time per token and group;
                 "channel": static per-channel scales calibrated on `calibration.text`
  value_scales   the same for values
  skip_layers    layer indices that stay float32
  smooth_keys    SmoothAttention strength α (QServe): keys are divided per channel by
                 amax_c^α and queries multiplied by it, folded into the q/k projections
                 (or qk-norm weights), shared by each rotary pair: exact in real arithmetic,
                 it flattens the key outliers that per-token scales suffer from.
  rotate         Hadamard rotation per head (QuaRot): of queries and keys in the graph
                 after RoPE (q·k unchanged), of values folded into v_proj rows and o_proj
                 columns (exact). Spreads outlier channels before per-token quantization.
The storage formats live in `compiler/kv_cache_format.py`; the reference model simulates
them, so the measured cost is the artifact's cost.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.kv_cache_format import CODE_MAX, FLOAT_KV_DTYPES, hadamard, kv_sides
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes.registry import PassContext, PassResult


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float16", "bfloat16", "fp8_e4m3", "int8", "int4"]
    group_size: int | None = Field(None, gt=0)
    value_group_size: int | None = Field(None, gt=0)
    key_scales: Literal["token", "channel"] = "token"
    value_scales: Literal["token", "channel"] = "token"
    skip_layers: list[int] = Field(default_factory=list)
    smooth_keys: float | None = Field(None, gt=0, le=1)
    rotate: bool = False
    calibration_samples: int = Field(16, gt=0)  # windows of calibration.text for statistics

    def needs_calibration_text(self) -> bool:
        """Static (channel) scales and smooth_keys come from calibration statistics."""
        return self.smooth_keys is not None or "channel" in (self.key_scales,
                                                              self.value_scales)


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    check_config(ir, config)
    out = ir.copy()
    layers = [i for i in range(ir.arch.num_layers) if i not in config.skip_layers]
    if config.rotate:  # first: static scales are calibrated on what the cache stores
        rotate_values(out, layers)
        for i in layers:
            out.arch = out.arch.replace_layer(i, kv_rotate_keys=True)
    stats = kv_statistics(out, config, context) if config.needs_calibration_text() else None
    if config.smooth_keys is not None and config.dtype not in FLOAT_KV_DTYPES:
        smooth_keys(out, stats, config.smooth_keys, layers)
    for i in layers:
        out.arch = out.arch.replace_layer(
            i, kv_dtype=config.dtype, kv_rotate_keys=config.rotate, kv_group_size=config.group_size,
            kv_value_group_size=config.value_group_size,
            kv_key_scales=config.key_scales, kv_value_scales=config.value_scales)
        if stats is not None and config.dtype not in FLOAT_KV_DTYPES:
            set_static_scales(out, i, stats[i], config)
    return PassResult(out, report(ir, out, time.perf_counter() - started, context))


def check_config(ir: ModelIR, config: Config) -> None:
    """One-line errors naming the key, before any work."""
    for i in config.skip_layers:
        if not 0 <= i < ir.arch.num_layers:
            raise ValueError(f"kv_cache.skip_layers: layer {i} does not exist "
                             f"(the model has {ir.arch.num_layers})")
    if config.rotate:
        quantized = [n for n in ir.quantized if n.endswith((".v_proj", ".o_proj"))]
        if quantized:
            raise ValueError(f"kv_cache.rotate: {quantized[0]} is already quantized; put "
                             "kv_cache before the weight-quantization pass")
        if config.smooth_keys is not None:
            raise ValueError("kv_cache.rotate: cannot be combined with smooth_keys "
                             "(the rotation spreads the channels smoothing would scale)")
        for spec in ir.arch.layers:
            if spec.head_dim & (spec.head_dim - 1):
                raise ValueError(f"kv_cache.rotate: head_dim {spec.head_dim} is not a power "
                                 "of two")
    for key in ("group_size", "value_group_size"):
        size = getattr(config, key)
        for spec in ir.arch.layers if size is not None else ():
            if spec.head_dim % size or (config.dtype == "int4" and size % 2):
                raise ValueError(f"kv_cache.{key}: {size} does not divide head_dim "
                                 f"{spec.head_dim} into groups of whole bytes")


def rotate_values(ir: ModelIR, layers: list[int]) -> None:
    """v' = H v per KV head (v_proj rows, bias) and o_proj's columns times H: exact."""
    for i in layers:
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


def kv_statistics(ir: ModelIR, config: Config,
                  context: PassContext) -> list[dict[str, torch.Tensor]]:
    """Per layer: absmax per channel of post-RoPE keys ([W]) and values ([W])."""
    from llmopt.compiler.calibration import calibration_windows

    if context is None or context.recipe.calibration.text is None:
        raise ValueError("kv_cache: static scales and smooth_keys need calibration.text")
    calibration = context.recipe.calibration
    calibration = calibration.model_copy(update={
        "samples": min(config.calibration_samples, calibration.samples)})
    windows = calibration_windows(ir, calibration)
    model = ReferenceModel(ir, windows.shape[1])
    stats = [{"key": torch.zeros(0), "value": torch.zeros(0)} for _ in ir.arch.layers]

    def observe(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, x in (("key", k), ("value", v)):
            amax = x.abs().flatten(0, 1).amax(0).flatten()  # [W]
            seen = stats[index][name]
            stats[index][name] = amax if seen.numel() == 0 else torch.maximum(seen, amax)

    model.kv_observer = observe
    for window in windows:
        model.forward(window[None], all_logits=False)
    return stats


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
        stats[i]["key"] = stats[i]["key"] / lam.expand(spec.num_kv_heads, -1).flatten()
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


def set_static_scales(ir: ModelIR, index: int, stats: dict[str, torch.Tensor],
                      config: Config) -> None:
    for side in kv_sides(ir.arch.layers[index]):
        if side.scales == "channel":
            scale = stats[side.name].clamp(min=1e-6) / CODE_MAX[config.dtype]
            ir.weights[f"layers.{index}.{side.static_scale_weight}"] = scale


def report(before: ModelIR, after: ModelIR, seconds: float,
           context: PassContext) -> dict[str, Any]:
    from llmopt.compiler.lower import cache_tensors
    from llmopt.runtime.manifest import KVCacheSpec

    def bytes_per_token(ir: ModelIR) -> int:
        return KVCacheSpec.model_validate({"layers": [
            {"tensors": cache_tensors(s)} for s in ir.arch.layers]}).bytes_per_token()

    probe = context.quality_probe(before) if context is not None else None
    return {
        "kv_dtypes": sorted({s.kv_dtype for s in after.arch.layers}),
        "bytes_per_token": {"before": bytes_per_token(before), "after": bytes_per_token(after)},
        "calibrate_seconds": round(seconds, 2),
        "quality": probe.compare(before, after) if probe else None,
    }
