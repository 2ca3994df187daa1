"""GQA head regrouping: fewer KV heads per layer, without retraining.

Recipe: `- gqa_regroup: {kv_heads: 1, kv_cache_reduction: 0.33, layers: auto, method: aligned,
fit: end_to_end, fit_steps: 600, held_out_windows: 8, max_ppl_increase_pct: null}`; the
calibration windows are the model's own samples unless the recipe names a text (the
end-to-end fit reads one a step, and keeps the step that scores best on the held-out ones).

Each chosen layer's KV heads are merged into `kv_heads` (MHA → GQA, or GQA → fewer), query
heads keeping their order: new KV head j serves the query heads of old KV heads
j*r .. j*r+r-1. `method: aligned` fits RoPE-exact complex key merges and o_proj-weighted value
subspaces to the calibration activations (compiler/head_merge.py); `mean` mean-pools the
K/V projections (the GQA paper's initialization), the baseline. With `layers: auto`, each
layer's merge is measured alone (KL of the final logits on a few calibration windows) and
the cheapest layers are merged until at least `kv_cache_reduction` of the KV bytes is saved.
A short fit then tunes the merged layers on the calibration windows (fit.py: by default a
distillation of the final logits from the original model). The result is a standard GQA
checkpoint with per-layer KV head counts.

Refused: qk-norm (Qwen3, Gemma 3) normalizes each key head between k_proj and RoPE, so a
merged head cannot be folded into k_proj exactly.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.compiler.calibration import calibration_windows, fast_bfloat16, final_kl_from_layer
from llmopt.compiler.head_merge import (
    AttentionWeights,
    InputMoments,
    Method,
    check_regroup,
    merge_heads,
)
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes.gqa_regroup.fit import FitPrecision, FitScope, fit_end_to_end, fit_layers

DEFAULT_FIT_STEPS = 600


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_heads: int = Field(gt=0)  # KV heads of every merged layer
    kv_cache_reduction: float | None = Field(None, gt=0, lt=1)  # with layers: auto
    layers: Literal["auto"] | list[int] = "auto"
    method: Method = "aligned"
    fit: Literal["end_to_end", "layer"] = "end_to_end"  # see fit.py
    fit_scope: FitScope = "layer"  # end_to_end: what of each merged layer it tunes
    fit_steps: int = Field(DEFAULT_FIT_STEPS, ge=0)  # Adam steps (per layer for fit: layer)
    fit_lr: float | None = Field(None, gt=0)  # default: 1e-4 end_to_end, 1e-3 layer
    # end_to_end matmuls in bfloat16 (mixed precision); auto: where the CPU has it natively
    fit_precision: Literal["auto"] | FitPrecision = "auto"
    fit_windows: int | None = Field(None, gt=0)  # default: all (end_to_end), 8 (layer)
    # end_to_end: the last calibration windows, never trained on, that choose the step whose
    # parameters are kept (early stopping, fit.py); 0: keep the last step's
    held_out_windows: int = Field(8, ge=0)
    moment_windows: int = Field(32, gt=0)  # calibration windows the input moments average
    sensitivity_windows: int = Field(2, gt=0)  # calibration windows each layer is measured on
    baseline: bool = True  # also measure mean pooling on the same layers
    max_ppl_increase_pct: float | None = Field(None, ge=0)  # this pass's own budget

    @model_validator(mode="after")
    def _one_way_to_choose(self) -> Config:
        if self.layers == "auto" and self.kv_cache_reduction is None:
            raise ValueError("layers: auto needs kv_cache_reduction")
        if self.layers != "auto" and self.kv_cache_reduction is not None:
            raise ValueError("give either layers or kv_cache_reduction, not both")
        if self.layers != "auto" and len(set(self.layers)) != len(self.layers):
            raise ValueError("layers lists a layer twice")
        return self

    def learning_rate(self) -> float:
        return self.fit_lr or (1e-4 if self.fit == "end_to_end" else 1e-3)

    def precision(self) -> FitPrecision:
        if self.fit_precision != "auto":
            return self.fit_precision
        return "bfloat16" if fast_bfloat16() else "float32"

    def needs_calibration_text(self) -> bool:
        """Only mean-pooling given layers without a fit needs no statistics."""
        return not (self.method == "mean" and self.layers != "auto" and not self.fit_steps)


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    candidates = _candidates(ir, config)
    sigmas, hidden, windows = _statistics(ir, candidates, config, context)
    sensitivity: dict[int, float] = {}
    if config.layers == "auto":
        sensitivity = measure_sensitivity(ir, [h[:config.sensitivity_windows] for h in hidden],
                                          sigmas, config, context)
        chosen = choose_layers(ir, sensitivity, config)
    else:
        chosen = sorted(config.layers)
    merged = regroup(ir, chosen, config.kv_heads, sigmas, config.method)
    fitted, fit_report = _fit(ir, merged, chosen, hidden, windows, config, context)
    result = fitted or merged
    report = _report(ir, result, merged if fitted else None, chosen, sensitivity, sigmas,
                     config, context)
    report.update(fit_report)
    report["pass_seconds"] = round(time.perf_counter() - started, 2)
    report["calibration_tokens"] = int(windows.numel())
    report["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return PassResult(result, report)


def _candidates(ir: ModelIR, config: Config) -> list[int]:
    """Layers that can be merged to `kv_heads`; a clear error for what cannot."""
    if ir.arch.qk_norm:
        raise ValueError(f"gqa_regroup: {ir.arch.family} normalizes each key head (qk-norm) "
                         "between k_proj and RoPE, so merged key heads cannot be folded into "
                         "k_proj exactly; not supported")
    touched = [n for n in ir.quantized if n.startswith("layers.")]
    if touched:
        raise ValueError(f"gqa_regroup: {touched[0]} is already quantized; regroup first")
    count = ir.arch.num_layers
    if config.layers != "auto":
        bad = [i for i in config.layers if not 0 <= i < count]
        if bad:
            raise ValueError(f"gqa_regroup: layer {bad[0]} out of range (0..{count - 1})")
        indices = list(config.layers)
    else:
        indices = [i for i, s in enumerate(ir.arch.layers) if s.num_kv_heads > config.kv_heads]
    for i in indices:
        check_regroup(ir.arch.layers[i], config.kv_heads, i)
    return indices


def _statistics(ir: ModelIR, candidates: list[int], config: Config, context: PassContext
                ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Input moments of the candidate layers, the kept residual streams and the calibration
    windows; none needed to mean-pool a given set of layers without a fit."""
    if not config.needs_calibration_text():
        return {}, [], torch.empty(0, 0, dtype=torch.long)
    started = time.perf_counter()
    windows = calibration_windows(ir, context.recipe.calibration, context.log)
    layer_fit = config.fit == "layer" and config.fit_steps
    keep = max(config.sensitivity_windows, (config.fit_windows or 8) if layer_fit else 0)
    averaged = windows[:config.moment_windows]
    moments, hidden = collect_statistics(ir, averaged, keep)
    context.log(f"      gqa_regroup: input moments of {len(candidates)} layers over "
                f"{averaged.numel()} tokens ({time.perf_counter() - started:.1f} s)")
    return {i: moments[i].matrix() for i in candidates}, hidden, windows


@torch.no_grad()
def collect_statistics(ir: ModelIR, windows: torch.Tensor, keep: int
                       ) -> tuple[list[InputMoments], list[torch.Tensor]]:
    """Each layer's attention-input moments over all windows, and the residual stream at
    every layer's input (and after the last) for the first `keep` windows."""
    model = ReferenceModel(ir, windows.shape[1])
    moments = [InputMoments() for _ in range(ir.arch.num_layers)]

    def observe(layer: int, name: str, x: torch.Tensor) -> None:
        if name == "q_proj":
            moments[layer].add(x)

    model.observer = observe
    positions = torch.arange(windows.shape[1])
    with model.holding(["embed_tokens"]):
        batches = [model.embed(windows[start:start + 4])
                   for start in range(0, windows.shape[0], 4)]
    hidden = [torch.cat(batches)[:keep]]
    for layer in range(ir.arch.num_layers):  # layer-major: each layer's weights read once
        batches = model.run_layers(batches, positions, layer, layer + 1)
        hidden.append(torch.cat(batches)[:keep])
    return moments, hidden


def regroup(ir: ModelIR, layers: list[int], kv_heads: int, sigmas: dict[int, torch.Tensor],
            method: Method) -> ModelIR:
    """A copy of `ir` with `layers` merged to `kv_heads` KV heads (a layer that has that
    many already is left as it is)."""
    out = ir.copy()
    for i in layers:
        spec = ir.arch.layers[i]
        if spec.num_kv_heads == kv_heads:
            continue  # nothing to merge: the layer stays exactly as it was
        weights = AttentionWeights.of_layer(ir.weights, i)
        merge_heads(weights, spec, kv_heads, sigmas.get(i), method).write(out.weights, i)
        out.arch = out.arch.replace_layer(i, num_kv_heads=kv_heads)
    return out


@torch.no_grad()
def measure_sensitivity(ir: ModelIR, hidden: list[torch.Tensor],
                        sigmas: dict[int, torch.Tensor], config: Config,
                        context: PassContext) -> dict[int, float]:
    """KL(original || this layer alone merged) of the final logits, per layer."""
    reference = ReferenceModel(ir, hidden[0].shape[1])
    with reference.holding_head():
        target = [torch.log_softmax(reference.logits(h[None]), -1) for h in hidden[-1]]
    sensitivity = {}
    for i in sigmas:
        started = time.perf_counter()
        model = ReferenceModel(regroup(ir, [i], config.kv_heads, sigmas, config.method),
                               hidden[0].shape[1])
        sensitivity[i] = round(final_kl_from_layer(model, i, hidden[i], target), 6)
        context.log(f"      gqa_regroup: layer {i} alone: KL {sensitivity[i]:.4g} "
                    f"({time.perf_counter() - started:.1f} s)")
    return sensitivity


def kv_bytes(ir: ModelIR) -> list[int]:
    """Bytes per token of each layer's K and V cache."""
    return [2 * s.num_kv_heads * s.head_dim * torch.empty(0, dtype=getattr(torch, s.kv_dtype))
            .element_size() for s in ir.arch.layers]


def choose_layers(ir: ModelIR, sensitivity: dict[int, float], config: Config) -> list[int]:
    """The least sensitive layers whose merge saves at least kv_cache_reduction of KV bytes."""
    sizes = kv_bytes(ir)
    needed, saved, chosen = config.kv_cache_reduction * sum(sizes), 0.0, []
    for i in sorted(sensitivity, key=sensitivity.get):
        if saved >= needed:
            break
        chosen.append(i)
        saved += sizes[i] * (1 - config.kv_heads / ir.arch.layers[i].num_kv_heads)
    if saved < needed:
        raise ValueError(f"gqa_regroup: merging every eligible layer to {config.kv_heads} KV "
                         f"heads saves {saved / sum(sizes):.3f} of the KV cache, less than "
                         f"kv_cache_reduction {config.kv_cache_reduction}")
    return sorted(chosen)


def _fit(ir: ModelIR, merged: ModelIR, chosen: list[int], hidden: list[torch.Tensor],
         windows: torch.Tensor, config: Config, context: PassContext
         ) -> tuple[ModelIR | None, dict[str, Any]]:
    """The merged layers tuned as `config.fit` says (None: no fit), and what the fit reports."""
    chosen = [i for i in chosen if merged.arch.layers[i].num_kv_heads
              != ir.arch.layers[i].num_kv_heads]  # a layer left as it was stays exact
    if not (config.fit_steps and chosen):
        return None, {}
    started = time.perf_counter()
    if config.fit == "layer":
        errors: dict[str, list[float]] = {}  # layer -> relative error [first, last step]
        fitted = fit_layers(ir, merged, chosen, [h[:config.fit_windows or 8] for h in hidden],
                            config.fit_steps, config.learning_rate(), context.log, errors)
        report: dict[str, Any] = {"fit_relative_error": errors}
    else:
        windows, held_out = split_held_out(windows, config.held_out_windows)
        windows = windows[:config.fit_windows]
        if config.fit_steps > len(windows):
            context.log(f"      gqa_regroup: {config.fit_steps} fit steps over {len(windows)} "
                        "calibration windows: each is seen more than once (more calibration "
                        "samples, up to fit_steps, generalize better)")
        precision = config.precision()
        fitted, report = fit_end_to_end(ir, merged, chosen, windows, config.fit_steps,
                                        config.learning_rate(), config.fit_scope, context.log,
                                        precision, held_out)
        report["fit_precision"] = precision
    report["fit_seconds"] = round(time.perf_counter() - started, 1)
    return fitted, report


def split_held_out(windows: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(windows to train on, the last `count` held out); none held out unless at least one
    window is left to train on."""
    if not count or len(windows) <= count:
        return windows, None
    return windows[:-count], windows[-count:]


def _report(ir: ModelIR, result: ModelIR, unfitted: ModelIR | None, chosen: list[int],
            sensitivity: dict[int, float], sigmas: dict[int, torch.Tensor], config: Config,
            context: PassContext) -> dict[str, Any]:
    before, after = kv_bytes(ir), kv_bytes(result)
    report: dict[str, Any] = {
        "layers_merged": chosen,
        "kv_heads": [s.num_kv_heads for s in result.arch.layers],
        "sensitivity_kl": {str(i): v for i, v in sensitivity.items()},
        "kv_bytes_per_token": {"before": sum(before), "after": sum(after)},
        "kv_cache_reduction": round(1 - sum(after) / sum(before), 4),
    }
    probe = context.quality_probe(ir) if context is not None else None
    report["quality"] = probe.compare(ir, result) if probe else None
    if probe and unfitted is not None:
        report["quality_before_fit"] = probe.compare(ir, unfitted)
    if probe and config.baseline and config.method != "mean":
        mean = regroup(ir, chosen, config.kv_heads, sigmas, "mean")
        report["quality_mean_pooling"] = probe.compare(ir, mean)
    return report
