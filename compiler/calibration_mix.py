"""Calibration windows that do not depend on the user having the right text: sequences the
model samples itself, mixed with windows of `calibration.text` when the recipe names one.

Why the model's own samples: a pass calibrated on one text learns that text (GPTQ's
Hessians, static KV scales and GQA's fit all do), and a deployment's text is rarely the
one at hand. What the model writes spans what it knows (prose, code, lists, chat), exists
for every model and language, and needs no file. `calibration.model_samples` is the share
of windows drawn from the model; `auto` takes every window from the model without a text
and MIXED_SHARE of them with one (benchmarks/README.md, quality_domains.py, measured on
the tuning split), and none from a model too large to sample (compiler/sample_budget.py).

Samples are drawn by compiler/model_samples.py with a seed of their own (SAMPLE_SEED), so
the quality probe's samples (the recipe's `quality.seed`) are other sequences. A compile
draws them once: passes asking for them again from the same model get the same tensor
back (`model_samples.SampleMemo`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.model_samples import memoized_samples
from llmopt.compiler.recipe import CalibrationConfig
from llmopt.compiler.sample_budget import (
    can_sample,
    check_calibration_source,
    parameter_count,
)
from llmopt.runtime.texts import windows_of

Log = Callable[[str], None]
MIXED_SHARE = 0.5  # `model_samples: auto` with a calibration.text
SAMPLE_SEED = 1_000_003  # the calibration samples' generator; the probe's uses quality.seed


def model_share(config: CalibrationConfig, num_parameters: int) -> float:
    """The share of calibration windows sampled from the model (`auto` resolved: none for
    a model too large to sample, compiler/sample_budget.py)."""
    if config.model_samples != "auto":
        return config.model_samples
    if not can_sample(num_parameters):
        return 0.0
    return 1.0 if config.text is None else MIXED_SHARE


def calibration_windows(ir: ModelIR, config: CalibrationConfig,
                        log: Log | None = None) -> torch.Tensor:
    """int64 [samples, seq_len]: round(share x samples) sequences sampled from `ir`, the rest
    the first windows of calibration.text, the two spread evenly through the set (a pass
    reading only its first windows sees both)."""
    num_parameters = parameter_count(ir.arch)
    check_calibration_source(config, num_parameters)
    sampled = round(model_share(config, num_parameters) * config.samples)
    if sampled < config.samples and config.text is None:
        raise ValueError("calibration.model_samples below 1 needs calibration.text")
    # a sampled window is at most the model's context: text windows beside it match it
    seq_len = min(config.seq_len, ir.arch.max_position) if sampled else config.seq_len
    text = torch.empty(0, seq_len, dtype=torch.int64)
    if sampled < config.samples:
        text = torch.tensor(windows_of(
            ir.text_token_ids(config.text), seq_len, config.samples - sampled,
            minimum=config.samples - sampled, source=f"calibration.text {config.text}"),
            dtype=torch.int64)
    model = (model_samples(ir, sampled, seq_len, log) if sampled
             else torch.empty(0, seq_len, dtype=torch.int64))
    return interleave(model, text)


def interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The rows of `a` and `b`, each set in order, spread evenly (a's first)."""
    total = len(a) + len(b)
    rows, ia, ib = [], 0, 0
    for i in range(total):
        take_a = -(-(i + 1) * len(a) // total) > -(-i * len(a) // total)  # ceil steps
        rows.append(a[ia] if take_a else b[ib])
        ia, ib = ia + take_a, ib + (not take_a)
    return torch.stack(rows) if rows else a


def model_samples(ir: ModelIR, count: int, seq_len: int, log: Log | None = None
                  ) -> torch.Tensor:
    """int64 [count, seq_len] sequences sampled from `ir` with SAMPLE_SEED (memoized:
    compiler/model_samples.py)."""
    seq_len = min(seq_len, ir.arch.max_position)
    return memoized_samples(ir, count, seq_len, SAMPLE_SEED, log)
