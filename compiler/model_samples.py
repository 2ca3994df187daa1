"""Text sampled from the model itself: the domain-free data that calibration
(compiler/calibration_mix.py) and the quality probe (compiler/quality.py) both read.

Sequences are drawn at temperature 1 from the BOS token (else the first EOS, the document
separator of tokenizers without BOS), EOS never drawn so each stays one document,
SAMPLE_BATCH sequences at a time from one seeded generator. `SampleMemo` keeps the last set
drawn so the passes of one compile share it; with `SampleMemo.directory` set, sets are also
kept on disk keyed by the model's contents, count, length and seed (a benchmark that
compiles the same model many times draws each set once).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import KVCache, ReferenceModel
from llmopt.compiler.weight_quant import intra_op_threads

Log = Callable[[str], None]
SAMPLE_BATCH = 64  # sequences sampled together: bounds the KV cache's memory
PROGRESS_EVERY_S = 10.0


@torch.no_grad()
def sample(ir: ModelIR, count: int, seq_len: int, seed: int, log: Log | None = None,
           what: str = "calibration") -> torch.Tensor:
    """int64 [count, seq_len]: sequences drawn from `ir` at temperature 1, SAMPLE_BATCH at a
    time, from one generator seeded `seed`; `what` labels the progress lines."""
    arch = ir.arch
    start = arch.bos_token_id if arch.bos_token_id is not None else (
        arch.eos_token_ids[0] if arch.eos_token_ids else 0)
    banned = [i for i in arch.eos_token_ids if i < arch.vocab_size]
    model, generator = ReferenceModel(ir, seq_len), torch.Generator().manual_seed(seed)
    # Every token reads every weight: they are read (and dequantized) once and held; a model
    # small enough to sample is small enough to hold (compiler/sample_budget.py).
    held = model.holding(list(ir.weights))
    started = last = time.perf_counter()
    if log is not None:
        log(f"      {what}: sampling {count} sequences of {seq_len} tokens from the model "
            f"(seed {seed})")
    batches = []
    # One token per sequence a step is many small ops: torch's thread pool costs more than
    # it gives there, and on shared cores it collapses.
    with intra_op_threads(1), held:
        for first in range(0, count, SAMPLE_BATCH):
            size = min(SAMPLE_BATCH, count - first)
            batches.append(_sample_batch(model, size, seq_len, start, banned, generator))
            now = time.perf_counter()
            if log is not None and (now - last >= PROGRESS_EVERY_S or first + size == count):
                log(f"      {what}: {first + size}/{count} sequences sampled, "
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


class SampleMemo:
    """The last sample set drawn, keyed by (fingerprint, seq_len, seed); `directory`: where
    sets are also kept on disk (None: memory only)."""

    key: tuple | None = None
    samples: torch.Tensor | None = None
    directory: Path | None = None


def memoized_samples(ir: ModelIR, count: int, seq_len: int, seed: int,
                     log: Log | None = None) -> torch.Tensor:
    """`sample(ir, count, seq_len, seed)`, or the first `count` rows of the memo's set when
    it was drawn from the same model, length and seed (a compile draws its set once)."""
    memo = SampleMemo
    key = (fingerprint(ir), seq_len, seed)
    if memo.key == key and memo.samples is not None and len(memo.samples) >= count:
        return memo.samples[:count]
    path = None if memo.directory is None else (
        Path(memo.directory) / f"samples-{key[0][:16]}-{count}x{seq_len}-{seed}.pt")
    if path is not None and path.is_file():
        drawn = torch.load(path)
    else:
        drawn = sample(ir, count, seq_len, seed, log)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(drawn, path)
    memo.key, memo.samples = key, drawn
    return drawn


def fingerprint(ir: ModelIR) -> str:
    """A digest of what sampling depends on: the architecture and every float weight."""
    digest = hashlib.sha1(repr(ir.arch).encode())
    for name in sorted(ir.weights):
        digest.update(name.encode())
        digest.update(ir.weights[name].detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


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
