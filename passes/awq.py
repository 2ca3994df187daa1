"""AWQ: activation-aware weight quantization (Lin et al., 2023, arXiv:2306.00978).

A few input channels carry much larger activations than the rest, so the weight columns
they multiply dominate a linear's output error. AWQ multiplies those columns by s > 1 and
divides the op that produces the input by s (the float model is unchanged), so group
quantization rounds them more finely. For each group of linears that share an input,
s = mean|x|^α with α grid-searched to minimize the group's output error on calibration
data; then each group of weights gets its own clipping ratio by the same measure, and
the weights are rounded: to nearest (`rounding: rtn`), or by GPTQ's error-feedback walk
under the same Gram, the clipped groups' scales and zeros kept (`rounding: gptq`, with
`refits` rounds of GPTQ's closed-form scale refit). The walk spends what nearest rounding
wastes: each column's error is pushed onto the columns not yet rounded.

Output errors go through the input's Gram matrix H = XᵀX: ||X(W - Ŵ)ᵀ||² =
tr((W - Ŵ) H (W - Ŵ)ᵀ), exact on the sampled tokens and cheaper than X itself once
there are more tokens than input channels. Layers are calibrated in order, and each
layer sees the outputs of the layers below it as quantized (`LayerwiseRunner.advance`).
The LM head, when included, gets the clipping search only: tied, it is also the embedding,
which a scale would change. Its perplexity against RTN's is in benchmarks/README.md.

Recipe: `- awq: {bits: 4, group_size: 128, symmetric: false, grid: 20, clip: true,
rounding: gptq, refits: 0}`;
calibration reads the model's own samples unless the recipe names a `calibration.text`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field

from llmopt.compiler.calibration import (
    LayerwiseRunner,
    calibration_precision,
    calibration_windows,
    symmetric_gram,
)
from llmopt.compiler.ir import ModelIR
from llmopt.compiler.pass_manager import PassContext, PassResult
from llmopt.compiler.quant_format import QuantizedLinear, group_view, quant_params
from llmopt.compiler.reference import rms_norm
from llmopt.compiler.weight_quant import (
    WeightQuantConfig,
    fake_quant,
    output_error,
    quantization_report,
    quantize_row_slices,
    round_to_nearest,
    search_clip,
    search_threads,
    target_linears,
)
from llmopt.passes.gptq import gptq_quantize, static_groups


class Config(WeightQuantConfig):
    grid: int = Field(20, ge=1, le=100)  # α in {0, 1/grid, ..., (grid-1)/grid}
    clip: bool = True  # search a clipping ratio per weight group
    search_tokens: int = Field(8192, gt=0)  # tokens per input the error Grams are built from
    # s = mean|x|^α / mean|ŵ|^(1-α), ŵ = |w| over its group's max (AutoAWQ's "duo scaling");
    # off: s = mean|x|^α as in the paper.
    duo_scaling: bool = True
    # How the scaled, clipped decoder weights are rounded: to nearest, or by GPTQ's error-
    # feedback walk (act-order, the clipped groups' scales and zeros kept) under the same
    # input Gram, with `refits` rounds of closed-form scale refits (passes/gptq.py).
    rounding: Literal["rtn", "gptq"] = "gptq"
    refits: int = Field(0, ge=0, le=8)

    def needs_calibration_text(self) -> bool:  # reads calibration windows
        return True


@dataclass(frozen=True)
class ScaleGroup:
    prev: str  # the op producing the group's input: a norm weight or a linear
    linears: tuple[str, ...]  # the linears that read it
    per_kv_head: bool = False  # the input is `prev`'s output repeated per query head (GQA)


# Which op each scale folds into. IR names are the same for every supported family, and
# norms are stored as effective multipliers (Gemma's 1 + w is folded at load), so dividing
# a norm by s is exact. A linear `prev` divides its rows and its bias by s. With grouped
# KV heads, o_proj reads each V head once per query head that shares it, so its scale is
# one per V channel, repeated.
SCALE_GROUPS = (
    ScaleGroup("attn_norm", ("q_proj", "k_proj", "v_proj")),
    ScaleGroup("v_proj", ("o_proj",), per_kv_head=True),
    ScaleGroup("mlp_norm", ("gate_proj", "up_proj")),
    ScaleGroup("up_proj", ("down_proj",)),
)


class TokenSampler:
    """Keeps each token with probability `keep`, reproducibly."""

    def __init__(self, keep: float):
        self.keep, self.generator = keep, torch.Generator().manual_seed(0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.rand(len(x), generator=self.generator) < self.keep]


class InputStats:
    """One linear input over the calibration set: mean |x| per channel over every token,
    and XᵀX over a random subsample of tokens."""

    def __init__(self, sampler: TokenSampler):
        self.sampler = sampler
        self.abs_sum = self.gram = None
        self.tokens = self.sampled = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        rows = self.sampler(x)
        abs_sum, gram = x.abs().sum(0, dtype=torch.float64), symmetric_gram(rows)
        if self.gram is None:
            self.abs_sum, self.gram = abs_sum, gram.double()
        else:  # float32 products into the float64 sum, in place
            self.abs_sum += abs_sum
            self.gram += gram
        self.tokens, self.sampled = self.tokens + len(x), self.sampled + len(rows)

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / self.tokens).float()

    def mean_gram(self) -> torch.Tensor:
        return (self.gram / max(1, self.sampled)).float()


def run(ir: ModelIR, config: Config, context: PassContext) -> PassResult:
    started = time.perf_counter()
    targets = set(target_linears(ir, config))
    windows = calibration_windows(ir, context.recipe.calibration, context.log)
    sampler = TokenSampler(min(1.0, config.search_tokens / windows.numel()))
    out = ir.copy()
    precision = calibration_precision(ir, context)
    runner = LayerwiseRunner(out, windows, precision=precision)
    errors, scales, clips = {}, {}, {}
    for layer in range(ir.arch.num_layers):
        layer_started = time.perf_counter()
        grams = scale_layer(out, runner, layer, targets, sampler, config, scales)
        for name in (n for n in grams if n in targets):
            errors[name], clips[name] = quantize_linear(out, name, grams[name], config)
        runner.advance()  # the next layer reads this one's quantized outputs
        chosen = [v["alpha"] for k, v in scales.items() if k.startswith(f"layers.{layer}.")]
        context.log(f"      awq: layer {layer + 1}/{ir.arch.num_layers}, α {chosen}, "
                    f"{time.perf_counter() - layer_started:.1f} s")
    if "lm_head" in targets:
        stats, final_norm = InputStats(sampler), out.weights["final_norm"]
        for hidden in runner.hidden:
            stats.add(rms_norm(hidden, final_norm, out.arch.norm_eps))
        errors["lm_head"], clips["lm_head"] = quantize_linear(
            out, "lm_head", stats.mean_gram(), config.for_linear("lm_head"))
    report = quantization_report(ir, out, errors, time.perf_counter() - started, context)
    report["awq"] = {"calibration_tokens": windows.numel(),
                     "calibration_precision": str(precision).removeprefix("torch."),
                     "scales": scales,
                     "mean_clip": {n: round(c, 4) for n, c in clips.items()}}
    return PassResult(out, report)


def scale_layer(ir: ModelIR, runner: LayerwiseRunner, layer: int, targets: set[str],
                sampler: TokenSampler, config: Config,
                scales: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Search and fold every group's scale in `layer`; returns each linear's input Gram
    (as its input is after folding), and records α per group in `scales`."""
    prefix, spec = f"layers.{layer}.", ir.arch.layers[layer]
    stats = {g.linears[0]: InputStats(sampler) for g in SCALE_GROUPS}
    runner.run_layer(lambda _, name, x: stats[name].add(x) if name in stats else None)
    grams = {}
    for group in SCALE_GROUPS:
        names = [prefix + n for n in group.linears]
        inputs = stats[group.linears[0]]
        gram = inputs.mean_gram()
        if targets & set(names):
            tie = spec.num_heads // spec.num_kv_heads if group.per_kv_head else 1
            layout = (tie, spec.head_dim)
            weights = [ir.weights[f"{n}.weight"] for n in names if n in targets]
            # The search's errors in the calibration's precision: its large products are
            # the search's cost, and their rounding is far below the differences it resolves.
            search_gram = gram.to(runner.model.matmul_dtype)
            # Hundreds of fake-quantizations: on small linears torch's thread pool costs
            # more than it saves (and collapses on shared cores)
            with search_threads(sum(w.numel() for w in weights)):
                alpha, s, ratio = search_scale(weights, inputs.mean_abs(), search_gram,
                                               layout, config)
            fold_scale(ir, prefix + group.prev, names, s, layout)
            s_in = _repeat_per_head(s, *layout)
            gram = gram / (s_in[:, None] * s_in[None, :])
            scales[f"{prefix}{group.prev}->{','.join(group.linears)}"] = {
                "alpha": alpha, "error_vs_rtn": round(ratio, 4)}
        grams.update(dict.fromkeys(names, gram))
    return grams


def search_scale(weights: list[torch.Tensor], mean_abs: torch.Tensor, gram: torch.Tensor,
                 layout: tuple[int, int], config: Config) -> tuple[float, torch.Tensor, float]:
    """(α, s over `prev`'s outputs, error / RTN's error) minimizing the summed output error
    of `weights` (which share the input that `mean_abs` and `gram` describe)."""
    mean_abs = _mean_per_kv_head(mean_abs, *layout).clamp(min=1e-8)
    w_mean = _mean_per_kv_head(relative_magnitude(weights, config.group_size), *layout)
    rtn_error = sum(output_error(w - fake_quant(w, config), gram) for w in weights)
    best = (math.inf, 0.0, torch.ones_like(mean_abs))
    for step in range(config.grid):
        alpha = step / config.grid
        s = mean_abs.pow(alpha)
        if config.duo_scaling:
            s = s / (w_mean.pow(1 - alpha) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s_in = _repeat_per_head(s, *layout)
        error = sum(output_error(w - fake_quant(w * s_in, config) / s_in, gram)
                    for w in weights)
        if error < best[0]:
            best = (error, alpha, s)
    return best[1], best[2], best[0] / max(rtn_error, 1e-30)


def relative_magnitude(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |w| / its group's max |w|, per input channel [K]."""
    w = torch.cat(weights).abs()
    groups = group_view(w, group_size)
    ratio = groups / (groups.amax(-1, keepdim=True) + 1e-6)
    return ratio.flatten(1)[:, : w.shape[1]].mean(0)


def fold_scale(ir: ModelIR, prev: str, names: list[str], s: torch.Tensor,
               layout: tuple[int, int] = (1, 1)) -> None:
    """Divide `prev`'s outputs by s and multiply the linears' input columns by it: the float
    model computes the same function."""
    w = ir.weights
    if prev.endswith("_proj"):
        w[f"{prev}.weight"] = w[f"{prev}.weight"] / s[:, None]
        if f"{prev}.bias" in w:
            w[f"{prev}.bias"] = w[f"{prev}.bias"] / s
    else:
        w[prev] = w[prev] / s
    s_in = _repeat_per_head(s, *layout)
    for name in names:
        w[f"{name}.weight"] = w[f"{name}.weight"] * s_in


def quantize_linear(ir: ModelIR, name: str, gram: torch.Tensor,
                    config: Config) -> tuple[float, float]:
    """Round `name` with the searched clipping, a slice of rows at a time; (relative weight
    error, mean clip ratio)."""
    # The head (the tied embedding too) stays at nearest: GPTQ would bend embedding rows
    # toward the head's inputs only.
    rounding = config.rounding if name != "lm_head" else "rtn"
    clips = []

    def quantize(part: torch.Tensor) -> QuantizedLinear:
        q, clip = round_weight(part, gram, config, rounding)
        clips.append(clip)
        return q

    q, error = quantize_row_slices(ir, name, config, quantize)
    ir.set_quantized(name, q)
    return error, 1.0 if clips[0] is None else float(torch.cat(clips).mean())


def round_weight(w: torch.Tensor, gram: torch.Tensor, config: Config, rounding: str
                 ) -> tuple[QuantizedLinear, torch.Tensor | None]:
    """w's codes after the clipping search (its ratios [N, G], None when off), rounded to
    nearest or by GPTQ's walk under `gram` with the clipped groups kept."""
    with search_threads(w.numel()):  # a grid of fake-quantizations, as search_scale
        clip = search_clip(w, gram, config) if config.clip else None
        if rounding == "rtn":
            return round_to_nearest(w, config, clip), clip
        codebook, static = static_groups(w, config, clip)
        if codebook is None and static is None:  # unclipped: the plain groups
            static = quant_params(w, config.bits, config.group_size, config.symmetric)
        q, _ = gptq_quantize(w, gram, config.bits, config.group_size, config.symmetric,
                             codebook=codebook, static=static, refits=config.refits)
    return q, clip


def _mean_per_kv_head(v: torch.Tensor, tie: int, head_dim: int) -> torch.Tensor:
    """[heads * head_dim] -> [kv_heads * head_dim], averaging the heads sharing a KV head."""
    return v if tie == 1 else v.view(-1, tie, head_dim).mean(1).reshape(-1)


def _repeat_per_head(s: torch.Tensor, tie: int, head_dim: int) -> torch.Tensor:
    """[kv_heads * head_dim] -> [heads * head_dim], as attention repeats KV heads."""
    if tie == 1:
        return s
    return s.view(-1, 1, head_dim).expand(-1, tie, head_dim).reshape(-1)
