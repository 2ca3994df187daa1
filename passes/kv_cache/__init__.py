"""KV cache dtype: store each layer's keys and values as float16, bfloat16, fp8 e4m3, int8 or
int4.

Recipe: `- kv_cache: {dtype: int8}`; options:
  group_size     channels per dynamic scale group (divides head_dim; default: one per head)
  value_group_size   values' group size when it differs (default: group_size)
  key_scales     "token": dynamic, computed in the graph at write time per token and group;
                 "channel": static per-channel scales calibrated on calibration windows;
                 "block": dynamic per channel within each paged block (KIVI), computed when
                 the block is full; a query reads its own block's keys unrounded (they wait
                 in float32 beside the pool until the block fills); "auto" (the default):
                 channel for int4 where the recipe names no layout (defaults.py), else token
  value_scales   the same for values
  static_scales  how channel scales are chosen: "search" (int8/int4: the clip per channel
                 that minimises attention-weighted rounding error, calibrate.py), "absmax"
                 (nothing clips), "auto" (search for int4, absmax otherwise)
  skip_layers    layer indices stored in `skip_dtype` (float32, or int8 with the same
                 scale options; auto: int8 for the int4 default, else float32) instead of
                 `dtype`
  auto_skip      N: the N layers whose cache suffers most from `dtype` (each measured alone
                 on calibration windows, sensitivity.py) join skip_layers. With int4 and
                 skip_dtype int8, a few layers buy most of int4's loss back (README table).
  max_kl         a quality target: the fewest most-sensitive layers (at least auto_skip) in
                 skip_dtype for which the whole cache's KL on calibration windows is at most
                 this; an error naming the key when even all but one layer do not reach it.
                 auto: defaults.py's target for the int4 default (as close as all but one
                 layer get), none otherwise.
  smooth_keys    SmoothAttention strength α (QServe): keys are divided per channel by
                 amax_c^α and queries multiplied by it, folded into the q/k projections
                 (or qk-norm weights), shared by each rotary pair: exact in real arithmetic,
                 it flattens the key outliers that per-token scales suffer from.
  sink_tokens    N: the first N positions of every sequence stay in float32 beside the
                 quantized cache (attention sinks: KVQuant, IntactKV); static scales are
                 then calibrated on the other positions. Needs the blocks KV layout.
  rotate         Hadamard rotation per head (QuaRot): of queries and keys in the graph
                 after RoPE (q·k unchanged), of values folded into v_proj rows and o_proj
                 columns (exact). Spreads outlier channels before quantization. `auto`
                 (the default): on for int8 wherever it applies (it removed int8's
                 perplexity cost in benchmarks/README.md's runs), off otherwise.
The storage formats live in `compiler/kv_cache_format.py`; the reference model simulates
them, so the measured cost is the artifact's cost.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmopt.compiler.calibration import calibration_windows
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.kv_cache_format import FLOAT_KV_DTYPES, kv_sides
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.passes.kv_cache import defaults
from llmopt.passes.kv_cache.calibrate import (
    SideStats,
    kv_absmax,
    kv_scale_statistics,
    searches,
    static_scale,
)
from llmopt.passes.kv_cache.folds import rotate_values, smooth_keys
from llmopt.passes.kv_cache.sensitivity import CacheKL, fewest_for_kl, layer_sensitivity

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float16", "bfloat16", "fp8_e4m3", "int8", "int4"]
    group_size: int | None = Field(None, gt=0)
    value_group_size: int | None = Field(None, gt=0)
    # auto (key_scales, value_scales, skip_dtype, max_kl): by dtype, defaults.py
    key_scales: Literal["auto", "token", "channel", "block"] = "auto"
    value_scales: Literal["auto", "token", "channel"] = "auto"
    static_scales: Literal["auto", "search", "absmax"] = "auto"  # see calibrate.py
    skip_layers: list[int] = Field(default_factory=list)
    skip_dtype: Literal["auto", "float32", "int8"] = "auto"
    auto_skip: int = Field(0, ge=0)  # the N most sensitive layers (measured) join skip_layers
    max_kl: Annotated[float, Field(gt=0)] | Literal["auto"] | None = "auto"  # ... or as many
    # as this KL target takes
    smooth_keys: float | None = Field(None, gt=0, le=1)
    rotate: bool | Literal["auto"] = "auto"
    sink_tokens: int = Field(0, ge=0)
    calibration_samples: int = Field(16, gt=0)  # windows of calibration.text for statistics

    def resolved(self) -> Config:
        """Every `auto` but rotate's set for the dtype (defaults.py)."""
        return defaults.resolved(self)

    def check_recipe(self, recipe: Recipe) -> None:
        """What the rest of the recipe rules out (preflight: before the model loads)."""
        self = self.resolved()
        _check_sinks(self.sink_tokens, recipe.runtime.max_context, "runtime.max_context")
        if self.sink_tokens > recipe.runtime.block_size:
            raise ValueError(f"kv_cache.sink_tokens: {self.sink_tokens} do not fit one block "
                             f"(runtime.block_size {recipe.runtime.block_size}): a sequence's "
                             "sinks live with its first block, which prefixes share")
        if self.key_scales == "block":
            _check_block_keys(self, recipe.runtime.block_size, recipe.target.kv_layout)
        if self.sink_tokens and recipe.target.kv_layout == "lanes":
            raise ValueError("kv_cache.sink_tokens: needs target.kv_layout blocks (lanes "
                             "round every position they store)")

    def needs_calibration_text(self) -> bool:
        """Static (channel) scales, smooth_keys, auto_skip and max_kl measure calibration
        windows."""
        self = self.resolved()
        return (self.smooth_keys is not None or self.auto_skip > 0 or self.max_kl is not None
                or "channel" in (self.key_scales, self.value_scales))


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    strict = defaults.max_kl_is_a_target(config)
    config = config.resolved()
    config = config.model_copy(update={"rotate": resolved_rotate(ir, config)})
    check_config(ir, config, context)
    block_size = context.recipe.runtime.block_size if context is not None else None
    out = ir.copy()
    kept = [i for i in range(ir.arch.num_layers) if i not in config.skip_layers]
    stored = {i: config.dtype if i in kept else config.skip_dtype
              for i in range(ir.arch.num_layers)}
    # drawn from the input model: the folds below are exact, and its samples are memoized
    windows = _windows(ir, config, context) if config.needs_calibration_text() else None
    if config.rotate:  # first: static scales are calibrated on what the cache stores
        rotated = [i for i, dtype in stored.items() if dtype != "float32"]
        rotate_values(out, rotated)
        for i in rotated:
            out.arch = out.arch.replace_layer(i, kv_rotate_keys=True)
    if config.smooth_keys is not None and config.dtype not in FLOAT_KV_DTYPES:
        smooth_keys(out, kv_absmax(out, windows, config.sink_tokens), config.smooth_keys, kept)
    stats = None
    if "channel" in (config.key_scales, config.value_scales):
        searched = {d for d in stored.values() if searches(config.static_scales, d)}
        stats = kv_scale_statistics(out, windows, searched, skip_first=config.sink_tokens)
    float_ir = out.copy()  # every fold made, every cache still float: what auto_skip scores

    def put(ir: ModelIR, index: int, dtype: str) -> None:
        store(ir, index, dtype, config, stats, block_size)

    for i, dtype in stored.items():
        put(out, i, dtype)
    sensitivity, kl_by_skipped = None, None
    if config.auto_skip or config.max_kl is not None:
        probe = CacheKL(float_ir, windows)
        sensitivity = layer_sensitivity(
            float_ir, lambda ir, i: put(ir, i, config.dtype), kept, probe,
            context.log)
        worst_first = sorted(kept, key=lambda i: -sensitivity[i])

        def skipping(n: int) -> ModelIR:  # `out` with the n most sensitive in skip_dtype
            skipped = out.copy()
            for i in worst_first[:n]:
                put(skipped, i, config.skip_dtype)
            return skipped

        count = config.auto_skip
        if config.max_kl is not None:
            fewest, kl_by_skipped = fewest_for_kl(
                lambda n: probe.of(skipping(n)), len(kept) - 1, config.max_kl, strict)
            count = max(count, fewest)
        for i in worst_first[:count]:
            stored[i] = config.skip_dtype
        out = skipping(count)
    extra = {"rotate": config.rotate,
             "skipped": sorted(i for i, d in stored.items() if d != config.dtype),
             "sensitivity_kl": sensitivity, "kl_by_skipped": kl_by_skipped}
    return PassResult(out, report(ir, out, time.perf_counter() - started, context, extra))


def resolved_rotate(ir: ModelIR, config: Config) -> bool:
    """`rotate: auto`: on for int8 where it applies (v/o weights still float, no key
    smoothing, head sizes powers of two), off for every other dtype (not measured to pay:
    absmax-scaled static int4 lost with it)."""
    if config.rotate != "auto":
        return config.rotate
    return (config.dtype == "int8" and config.smooth_keys is None
            and rotation_unsupported(ir) is None)


def rotation_unsupported(ir: ModelIR) -> str | None:
    """Why the values' rotation cannot be folded into this model (None: it can)."""
    quantized = [n for n in ir.quantized if n.endswith((".v_proj", ".o_proj"))]
    if quantized:
        return (f"{quantized[0]} is already quantized; put kv_cache before the "
                "weight-quantization pass")
    for spec in ir.arch.layers:
        if spec.head_dim & (spec.head_dim - 1):
            return f"head_dim {spec.head_dim} is not a power of two"
    return None


def _check_block_keys(config: Config, block_size: int, kv_layout: str) -> None:
    if config.dtype in ("float16", "bfloat16"):
        raise ValueError(f"kv_cache.key_scales: block needs a quantized dtype, not "
                         f"{config.dtype}")
    if "int4" in (config.dtype, config.skip_dtype) and block_size % 2:
        raise ValueError(f"kv_cache.key_scales: block needs an even runtime.block_size for "
                         f"int4 (two positions a byte), got {block_size}")
    if config.sink_tokens:
        raise ValueError("kv_cache.sink_tokens: not with key_scales block (a query already "
                         "reads its own block unrounded)")
    if kv_layout == "lanes":
        raise ValueError("kv_cache.key_scales: block needs target.kv_layout blocks")


def _check_sinks(sink_tokens: int, context: int, what: str) -> None:
    if sink_tokens >= context:
        raise ValueError(f"kv_cache.sink_tokens: {sink_tokens} is beyond the context "
                         f"({what}: {context} positions)")


def _windows(ir: ModelIR, config: Config, context: PassContext | None):
    if context is None:
        raise ValueError("kv_cache: static scales, smooth_keys, auto_skip and max_kl need "
                         "the recipe's calibration block")
    calibration = context.recipe.calibration
    return calibration_windows(ir, calibration.model_copy(update={
        "samples": min(config.calibration_samples, calibration.samples)}), context.log)


def store(ir: ModelIR, index: int, dtype: str, config: Config,
          stats: list[dict[str, SideStats]] | None, block_size: int | None = None) -> None:
    """Set layer `index` to store its KV cache in `dtype` (float32: as the input IR did;
    per-block key scales over blocks of `block_size`)."""
    for side in ("key", "value"):
        ir.weights.pop(f"layers.{index}.{side}_cache_scale", None)
    if dtype == "float32":
        ir.arch = ir.arch.replace_layer(index, kv_dtype="float32", kv_rotate_keys=False,
                                        kv_group_size=None, kv_value_group_size=None,
                                        kv_key_scales="token", kv_value_scales="token",
                                        kv_sink_tokens=0, kv_block_size=None)
        return
    ir.arch = ir.arch.replace_layer(
        index, kv_dtype=dtype, kv_rotate_keys=config.rotate, kv_group_size=config.group_size,
        kv_value_group_size=config.value_group_size,
        kv_key_scales=config.key_scales, kv_value_scales=config.value_scales,
        kv_sink_tokens=config.sink_tokens,
        kv_block_size=block_size if config.key_scales == "block" else None)
    for side in kv_sides(ir.arch.layers[index]):
        if side.scales == "channel" and side.quantized:
            ir.weights[f"layers.{index}.{side.static_scale_weight}"] = static_scale(
                stats[index][side.name], dtype, config.static_scales)


def check_config(ir: ModelIR, config: Config, context: PassContext | None = None) -> None:
    """One-line errors naming the key, before any work."""
    if context is not None:
        config.check_recipe(context.recipe)
    _check_sinks(config.sink_tokens, ir.arch.max_position, "the model's positions")
    if config.key_scales == "block" and context is None:
        raise ValueError("kv_cache.key_scales: block needs the recipe's runtime.block_size")
    for i in config.skip_layers:
        if not 0 <= i < ir.arch.num_layers:
            raise ValueError(f"kv_cache.skip_layers: layer {i} does not exist "
                             f"(the model has {ir.arch.num_layers})")
    if config.skip_dtype == config.dtype:
        raise ValueError(f"kv_cache.skip_dtype: {config.dtype} is the pass's dtype already")
    kept = ir.arch.num_layers - len(set(config.skip_layers))
    if config.auto_skip >= kept:
        raise ValueError(f"kv_cache.auto_skip: {config.auto_skip} would leave no layer in "
                         f"{config.dtype} ({kept} not in skip_layers)")
    if config.rotate:
        reason = rotation_unsupported(ir)
        if reason:
            raise ValueError(f"kv_cache.rotate: {reason}")
        if config.smooth_keys is not None:
            raise ValueError("kv_cache.rotate: cannot be combined with smooth_keys "
                             "(the rotation spreads the channels smoothing would scale)")
    for key in ("group_size", "value_group_size"):
        size = getattr(config, key)
        for spec in ir.arch.layers if size is not None else ():
            if spec.head_dim % size or (config.dtype == "int4" and size % 2):
                raise ValueError(f"kv_cache.{key}: {size} does not divide head_dim "
                                 f"{spec.head_dim} into groups of whole bytes")


def report(before: ModelIR, after: ModelIR, seconds: float, context: PassContext | None,
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from llmopt.compiler.kv_layout import kv_cache_spec
    from llmopt.runtime.manifest import KVCacheSpec

    def bytes_per_token(ir: ModelIR) -> float:
        return KVCacheSpec.model_validate(kv_cache_spec(ir.arch, "blocks")).bytes_per_token()

    near_exact = _near_exact(after)
    probe = (context.quality_probe(before) if context is not None and near_exact is None
             else None)
    skipped = {"quality_skipped": near_exact} if near_exact and context is not None else {}
    return {
        "kv_dtypes": sorted({s.kv_dtype for s in after.arch.layers}),
        "bytes_per_token": {"before": bytes_per_token(before), "after": bytes_per_token(after)},
        "calibrate_seconds": round(seconds, 2),
        **(extra or {}),
        "quality": probe.compare(before, after) if probe else None,
        **skipped,
    }


# Significant bits each float cache dtype keeps of a float32 key or value.
NEAR_EXACT_BITS = {"float16": 11, "bfloat16": 8}


def _near_exact(after: ModelIR) -> str | None:
    """Why a cache stored only in float16/bfloat16 is not worth a quality probe, or None."""
    dtypes = {layer.kv_dtype for layer in after.arch.layers} - {"float32"}
    if not dtypes or not dtypes <= NEAR_EXACT_BITS.keys():
        return None
    kept = ", ".join(f"{d} keeps {NEAR_EXACT_BITS[d]} significant bits" for d in sorted(dtypes))
    return f"a float cache only ({kept} of each key and value) is near-exact"
