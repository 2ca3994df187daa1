"""Calibration windows that do not depend on the user having the right text: sequences the
model samples itself, mixed with windows of `calibration.text` when the recipe names one.

Why the model's own samples: a pass calibrated on one text learns that text (GPTQ's
Hessians, static KV scales and GQA's fit all do), and a deployment's text is rarely the
one at hand. What the model writes spans what it knows (prose, code, lists, chat), exists
for every model and language, and needs no file. `calibration.model_samples` is the share
of windows drawn from the model; `auto` takes every window from the model without a text
and MIXED_SHARE of them with one (benchmarks/README.md, quality_domains.py, measured on
the tuning split), and none from a model too large to sample (compiler/sample_budget.py).

Samples are drawn at temperature 1 from the BOS token (else the first EOS), EOS never
drawn, with a seed of their own (SAMPLE_SEED), so the quality probe's samples (the
recipe's `quality.seed`) are other sequences. A compile draws them once: passes asking
for them again from the same model get the same tensor back (`_SampleMemo`).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.recipe import CalibrationConfig
from llmopt.compiler.reference import KVCache, ReferenceModel
from llmopt.compiler.sample_budget import (
    can_sample,
    check_calibration_source,
    parameter_count,
)
from llmopt.compiler.weight_quant import intra_op_threads
from llmopt.runtime.tools.evaluate import windows_of

Log = Callable[[str], None]
MIXED_SHARE = 0.5  # `model_samples: auto` with a calibration.text
SAMPLE_SEED = 1_000_003  # the calibration samples' generator; the probe's uses quality.seed
SAMPLE_BATCH = 64  # sequences sampled together: bounds the KV cache's memory
PROGRESS_EVERY_S = 10.0


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


class _SampleMemo:
    """The last sample set drawn, keyed by the model's contents and the set's shape: the
    passes of one compile share it rather than draw it again."""

    key: tuple | None = None
    samples: torch.Tensor | None = None


def model_samples(ir: ModelIR, count: int, seq_len: int, log: Log | None = None
                  ) -> torch.Tensor:
    """int64 [count, seq_len] sequences sampled from `ir` (memoized: see the module)."""
    seq_len = min(seq_len, ir.arch.max_position)
    key = (fingerprint(ir), seq_len)
    memo = _SampleMemo
    if memo.key == key and memo.samples is not None and len(memo.samples) >= count:
        return memo.samples[:count]
    drawn = sample(ir, count, seq_len, SAMPLE_SEED, log)
    memo.key, memo.samples = key, drawn
    return drawn


def fingerprint(ir: ModelIR) -> str:
    """A digest of what sampling depends on: the architecture and every float weight."""
    digest = hashlib.sha1(repr(ir.arch).encode())
    for name in sorted(ir.weights):
        digest.update(name.encode())
        digest.update(ir.weights[name].detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


@torch.no_grad()
def sample(ir: ModelIR, count: int, seq_len: int, seed: int, log: Log | None = None
           ) -> torch.Tensor:
    """`count` sequences of `seq_len` tokens drawn from `ir` at temperature 1, SAMPLE_BATCH
    at a time, from one seeded generator."""
    arch = ir.arch
    start = arch.bos_token_id if arch.bos_token_id is not None else (
        arch.eos_token_ids[0] if arch.eos_token_ids else 0)
    banned = [i for i in arch.eos_token_ids if i < arch.vocab_size]
    model, generator = ReferenceModel(ir, seq_len), torch.Generator().manual_seed(seed)
    started = last = time.perf_counter()
    if log is not None:
        log(f"      calibration: sampling {count} sequences of {seq_len} tokens from the "
            "model")
    batches = []
    # One token per sequence a step is many small ops: one thread (see weight_quant).
    with intra_op_threads(1):
        for first in range(0, count, SAMPLE_BATCH):
            size = min(SAMPLE_BATCH, count - first)
            batches.append(_sample_batch(model, size, seq_len, start, banned, generator))
            now = time.perf_counter()
            if log is not None and (now - last >= PROGRESS_EVERY_S or first + size == count):
                log(f"      calibration: {first + size}/{count} sequences sampled, "
                    f"{now - started:.0f} s")
                last = now
    return torch.cat(batches)


def _sample_batch(model: ReferenceModel, size: int, seq_len: int, start: int,
                  banned: list[int], generator: torch.Generator) -> torch.Tensor:
    cache = PreallocatedCache(model.arch.num_layers, seq_len)
    tokens = torch.full((size, seq_len), start, dtype=torch.int64)
    logits = model.forward(tokens[:, :1], cache, all_logits=False)
    for position in range(1, seq_len):
        logits[:, banned] = -math.inf
        drawn = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)
        tokens[:, position] = drawn[:, 0]
        if position + 1 < seq_len:
            logits = model.forward(drawn, cache, all_logits=False)
    return tokens


class PreallocatedCache(KVCache):
    """KVCache writing into buffers of the final length: appending a token costs a copy of
    that token, not of the whole cache."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__()
        self.num_layers, self.capacity, self.used = num_layers, capacity, 0
        self.key_buffers: list[torch.Tensor] = []
        self.value_buffers: list[torch.Tensor] = []

    def length(self) -> int:
        return self.used

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if layer == len(self.key_buffers):  # layers append in order, the first step sizes them
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.key_buffers.append(torch.empty(shape, dtype=k.dtype))
            self.value_buffers.append(torch.empty(shape, dtype=v.dtype))
        end = self.used + k.shape[2]
        self.key_buffers[layer][:, :, self.used:end] = k
        self.value_buffers[layer][:, :, self.used:end] = v
        if layer == self.num_layers - 1:
            self.used = end  # every layer has stored this step's tokens
        return self.key_buffers[layer][:, :, :end], self.value_buffers[layer][:, :, :end]
