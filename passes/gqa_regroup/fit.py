"""Tuning merged layers after the merge, on the calibration windows.

`fit: layer` tunes each merged layer's q/k/v/o alone against the original layer's attention
output. It is cheap and the layers are independent, but a layer cannot see what its error
does downstream.

`fit: end_to_end` tunes all merged layers at once to minimize KL(original ‖ merged) of the
final logits: a short distillation from the original model. Later merged layers learn to
absorb earlier ones' errors, and the loss weighs an error by what it does to the next-token
distribution. `fit_scope: layer` also frees the merged layers' MLPs and norms, which gives
the merge more room to compensate. Layers below the first merged one are frozen, so their
output is computed without gradients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import ReferenceModel, rms_norm

FitScope = Literal["attention", "layer"]
FitPrecision = Literal["float32", "bfloat16"]
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER = (*_ATTENTION, "gate_proj", "up_proj", "down_proj", "attn_norm", "mlp_norm",
          "post_attn_norm", "post_mlp_norm")
Log = Callable[[str], None]


def trainable(ir: ModelIR, layers: list[int], scope: FitScope) -> list[str]:
    """Names of the weights (and biases) a fit of `layers` may change."""
    parts = _ATTENTION if scope == "attention" else _LAYER
    return [n for n in ir.weights if n.startswith("layers.")
            and int(n.split(".")[1]) in layers and n.split(".")[2] in parts]


def fit_layers(ir: ModelIR, merged: ModelIR, layers: list[int], hidden: list[torch.Tensor],
               steps: int, lr: float, log: Log, errors: dict[str, list[float]]) -> ModelIR:
    """Adam on each merged layer's q/k/v/o against the original attention output
    (relative squared error of each layer's first and last step into `errors`)."""
    out = merged.copy()
    seq = hidden[0].shape[1]
    positions = torch.arange(seq)
    reference = ReferenceModel(ir, seq)
    for i in layers:
        started = time.perf_counter()
        x = rms_norm(hidden[i], ir.weights[f"layers.{i}.attn_norm"], ir.arch.norm_eps)
        with torch.no_grad():
            target = reference.attention(i, x, positions, None)
        params, model = _trainable_copy(out, trainable(out, [i], "attention"), seq)
        optimizer = torch.optim.Adam(params.values(), lr=lr)
        scale = float(target.pow(2).mean())
        first = last = 0.0
        for step in range(steps):
            sample = step % x.shape[0]
            loss = (model.attention(i, x[sample:sample + 1], positions, None)
                    - target[sample:sample + 1]).pow(2).mean() / scale
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            value = float(loss.detach())
            first, last = (value if step == 0 else first), value
        out.weights.update({n: p.detach() for n, p in params.items()})
        errors[str(i)] = [round(first, 6), round(last, 6)]
        log(f"      gqa_regroup: fit layer {i}: relative error {first:.4g} -> {last:.4g} "
            f"({time.perf_counter() - started:.1f} s)")
    return out


def fit_end_to_end(ir: ModelIR, merged: ModelIR, layers: list[int], windows: torch.Tensor,
                   steps: int, lr: float, scope: FitScope, log: Log,
                   precision: FitPrecision = "float32", held_out: torch.Tensor | None = None,
                   ) -> tuple[ModelIR, dict[str, Any]]:
    """Adam on the merged layers against KL(original ‖ merged) of the final logits, one
    calibration window a step, cosine-decayed learning rate. Returns the tuned model and a
    report: `fit_kl`, the mean KL of the first and the last tenth of the steps.

    `held_out` windows (never trained on) are scored before the fit and every tenth of the
    steps; the parameters that score best there are kept (early stopping: the fit stops
    helping where it starts learning its own windows). `held_out_kl`: before, and kept.

    `bfloat16` runs the matmuls of both models in bfloat16 (torch autocast; the weights,
    their gradients, Adam's state and the loss stay float32): mixed precision, as GPU
    training does, for CPUs with native bfloat16 arithmetic."""
    seq = windows.shape[1]
    positions = torch.arange(seq)
    teacher = ReferenceModel(ir, seq)
    params, student = _trainable_copy(merged, trainable(merged, layers, scope), seq)
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    first = min(layers)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bfloat16")

    def window_kl(ids: torch.Tensor) -> torch.Tensor:
        with autocast:
            with torch.no_grad():
                h = _run_layers(teacher, teacher.embed(ids), range(first), positions)
                target = torch.log_softmax(teacher.logits(_run_layers(
                    teacher, h, range(first, ir.arch.num_layers), positions)).float(), -1)
            out = _run_layers(student, h, range(first, ir.arch.num_layers), positions)
            logits = student.logits(out).float()
        return torch.sum(target.exp() * (target - torch.log_softmax(logits, -1)), -1).mean()

    check = _HeldOut(held_out, window_kl, params)
    kls: list[float] = []
    started = last_log = time.perf_counter()
    every = max(1, steps // 10)
    for step in range(steps):
        loss = window_kl(windows[step % windows.shape[0]][None])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        kls.append(float(loss.detach()))
        if (step + 1) % every == 0 or step == steps - 1:
            check.score(step + 1)
        if time.perf_counter() - last_log > 30 or step == steps - 1:
            last_log = time.perf_counter()
            log(f"      gqa_regroup: end-to-end fit step {step + 1}/{steps}: KL "
                f"{sum(kls[-10:]) / len(kls[-10:]):.4f}{check.line()} "
                f"({last_log - started:.0f} s)")
    tuned = merged.copy()
    tuned.weights.update(check.best_params())
    tenth = max(1, steps // 10)
    report: dict[str, Any] = {"fit_kl": [round(sum(kls[:tenth]) / tenth, 6),
                                         round(sum(kls[-tenth:]) / tenth, 6)]}
    return tuned, {**report, **check.report()}


class _HeldOut:
    """Early stopping: the trained parameters' KL on windows the fit never reads, and a copy
    of the best so far (step 0: the merge as it was)."""

    def __init__(self, windows: torch.Tensor | None, window_kl: Callable[[torch.Tensor], Any],
                 params: dict[str, torch.Tensor]):
        self.windows, self.window_kl, self.params = windows, window_kl, params
        self.first = self.best = None
        self.best_step, self.kept = 0, None
        if windows is not None and len(windows):
            self.score(0)

    @torch.no_grad()
    def score(self, step: int) -> None:
        if self.windows is None or not len(self.windows):
            return
        kl = sum(float(self.window_kl(w[None])) for w in self.windows) / len(self.windows)
        self.first = kl if self.first is None else self.first
        if self.best is None or kl < self.best:
            self.best, self.best_step = kl, step
            self.kept = {n: p.detach().clone() for n, p in self.params.items()}

    def line(self) -> str:
        return "" if self.best is None else f", held out {self.best:.4f} (step {self.best_step})"

    def best_params(self) -> dict[str, torch.Tensor]:
        return self.kept if self.kept is not None else {
            n: p.detach() for n, p in self.params.items()}

    def report(self) -> dict[str, Any]:
        if self.best is None:
            return {}
        return {"held_out_kl": [round(self.first, 6), round(self.best, 6)],
                "kept_step": self.best_step}


def _trainable_copy(ir: ModelIR, names: list[str], seq: int
                    ) -> tuple[dict[str, torch.Tensor], ReferenceModel]:
    """Leaf tensors for `names`, and a reference model of `ir` that reads them."""
    params = {n: ir.weights[n].clone().requires_grad_(True) for n in names}
    trial = ir.copy()
    trial.weights.update(params)
    return params, ReferenceModel(trial, seq)


def _run_layers(model: ReferenceModel, hidden: torch.Tensor, layers: range,
                positions: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        hidden = model.layer_forward(layer, hidden, positions, None)
    return hidden
