"""Distil a draft from the target: minimise KL(p_target ‖ q_draft) of the next-token
distributions on calibration text (or on the target's own continuations, with a mask
that counts only their positions), with AdamW on the CPU.

The draft's logits rows cover the target ids in its token map, so the target's
distribution is restricted to those ids and renormalised before the KL. The report
gives the KL on held-out windows before and after, the loss curve and the time.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import ReferenceModel, rms_norm
from llmopt.runtime.texts import windows_of


@dataclass(frozen=True)
class DistillSettings:
    steps: int
    lr: float
    batch_size: int
    trainable: tuple[str, ...]  # glob patterns of weight names that train
    eval_windows: int = 4  # held out from training, for the before/after KL


def text_windows(ir: ModelIR, text_file: str | Path, seq_len: int) -> torch.Tensor:
    """int64 [n, seq_len]: every non-overlapping window of the text, in target ids."""
    windows = windows_of(ir.text_token_ids(text_file), seq_len, minimum=2,
                         source=str(text_file))
    return torch.tensor(windows, dtype=torch.int64)


def distill(draft: ModelIR, target: ModelIR, windows: torch.Tensor,
            token_map: torch.Tensor | None, settings: DistillSettings,
            log: Callable[[str], None], mask: torch.Tensor | None = None
            ) -> tuple[ModelIR, dict]:
    """A copy of `draft` trained towards `target`, and the distillation report. `mask`
    [n, seq_len] weighs each position's KL (None: all count)."""
    started = time.perf_counter()
    held = min(settings.eval_windows, len(windows) // 2)
    mask = torch.ones(windows.shape) if mask is None else mask
    train, held_out = windows[held:], windows[:held]
    train_mask, held_mask = mask[held:], mask[:held]
    teacher = ReferenceModel(target, windows.shape[1])
    out, params = _trainable_copy(draft, settings.trainable)
    student = ReferenceModel(out, windows.shape[1])
    kl_before = held_out_kl(teacher, student, held_out, token_map, held_mask)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(settings.steps))
    losses = []
    for step in range(settings.steps):
        rows = torch.arange(step * settings.batch_size, (step + 1) * settings.batch_size)
        rows = rows % len(train)
        loss = kl_loss(teacher, student, train[rows], token_map, train_mask[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % max(1, settings.steps // 10) == 0:
            log(f"      distill step {step + 1}/{settings.steps}: KL {losses[-1]:.4f} "
                f"({time.perf_counter() - started:.0f} s)")
    out.weights = {n: t.detach() for n, t in out.weights.items()}
    kl_after = held_out_kl(teacher, student, held_out, token_map, held_mask)
    return out, {
        "steps": settings.steps, "lr": settings.lr, "batch_size": settings.batch_size,
        "seq_len": windows.shape[1], "trained_parameters": sum(p.numel() for p in params),
        "held_out_kl_before": round(kl_before, 5), "held_out_kl_after": round(kl_after, 5),
        "loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 20)]],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _trainable_copy(draft: ModelIR, patterns: tuple[str, ...]
                    ) -> tuple[ModelIR, list[torch.Tensor]]:
    """A copy whose matching weights are fresh leaf tensors requiring grad; quantized
    linears among them lose their integer form (the weights will move off the grid)."""
    out = draft.copy()
    params = []
    for name, tensor in draft.weights.items():
        if any(fnmatch.fnmatch(name, p) for p in patterns):
            out.weights[name] = tensor.detach().clone().requires_grad_(True)
            params.append(out.weights[name])
    for linear in list(out.quantized):
        if out.weights[out.weight_name(linear)].requires_grad:
            del out.quantized[linear]
    if not params:
        raise ValueError(f"no draft weight matches the trainable patterns {list(patterns)}")
    return out, params


def student_logits(model: ReferenceModel, ids: torch.Tensor) -> torch.Tensor:
    """The reference forward with autograd (ReferenceModel.forward runs without it)."""
    positions = torch.arange(ids.shape[1])
    hidden = model.embed(ids)
    for index in range(model.arch.num_layers):
        hidden = model.layer_forward(index, hidden, positions, None)
    return model.logits(hidden)


def kl_loss(teacher: ReferenceModel, student: ReferenceModel, ids: torch.Tensor,
            token_map: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens (weighted by `mask`) of KL(p ‖ q), p the target's distribution
    over the draft's rows."""
    with torch.no_grad():
        logp = torch.log_softmax(teacher_logits(teacher, ids, token_map), dim=-1)
    logq = torch.log_softmax(student_logits(student, ids), dim=-1)
    per_token = (logp.exp() * (logp - logq)).sum(-1)
    if mask is None:
        return per_token.mean()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def teacher_logits(teacher: ReferenceModel, ids: torch.Tensor,
                   token_map: torch.Tensor | None) -> torch.Tensor:
    """The target's logits on the draft's rows only (a trimmed head skips most of its LM
    head, a large share of a small model's compute per token)."""
    if token_map is None:
        return teacher.forward(ids)
    positions = torch.arange(ids.shape[1])
    hidden = teacher.embed(ids)
    for index in range(teacher.arch.num_layers):
        hidden = teacher.layer_forward(index, hidden, positions, None)
    arch, weights = teacher.arch, teacher.ir.weights
    logits = rms_norm(hidden, weights["final_norm"], arch.norm_eps) @ (
        teacher.ir.lm_head()[token_map].T)
    if arch.final_softcap:
        logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
    return logits


def held_out_kl(teacher: ReferenceModel, student: ReferenceModel, ids: torch.Tensor,
                token_map: torch.Tensor | None, mask: torch.Tensor | None = None) -> float:
    masks = [None] * len(ids) if mask is None else [m[None] for m in mask]
    with torch.no_grad():
        return float(sum(kl_loss(teacher, student, w[None], token_map, m)
                         for w, m in zip(ids, masks, strict=True)) / len(ids))


def _warmup_cosine(steps: int) -> Callable[[int], float]:
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor
