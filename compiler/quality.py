"""What a lossy pass costs: perplexity, KL divergence and top-1 agreement against the IR
it started from, on held-out text (the recipe's `quality.eval_text`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import ReferenceModel
from llmopt.runtime.evaluate import windows_of

PROGRESS_EVERY_S = 10.0  # a measurement takes minutes on SmolLM2: say how far it got


@dataclass(frozen=True)
class QualityProbe:
    windows: list[list[int]]  # token windows of held-out text
    log: Callable[[str], None] | None = None  # progress lines for the compile log

    @classmethod
    def from_text(cls, ir: ModelIR, text_file: str | Path, windows: int, seq_len: int,
                  tail: bool = False, log: Callable[[str], None] | None = None) -> QualityProbe:
        """The first `windows` windows of the text; its last ones with `tail` (held out
        from calibration, which takes the first)."""
        every = windows_of(ir.text_token_ids(text_file), seq_len, source=str(text_file))
        return cls(every[-windows:] if tail else every[:windows], log)

    @torch.no_grad()
    def compare(self, before: ModelIR, after: ModelIR) -> dict[str, float]:
        """Next-token quality of `after` relative to `before`, window by window."""
        ref, new = ReferenceModel(before, len(self.windows[0])), ReferenceModel(after,
                                                                                len(self.windows[0]))
        nll_before = nll_after = kl = agree = 0.0
        count = 0
        progress = _Progress(self.log, len(self.windows), len(self.windows[0]))
        for window in self.windows:
            ids = torch.tensor([window])
            logp = torch.log_softmax(ref.forward(ids)[0, :-1], dim=-1)
            logq = torch.log_softmax(new.forward(ids)[0, :-1], dim=-1)
            targets = torch.tensor(window[1:])[:, None]
            nll_before -= logp.gather(1, targets).sum().item()
            nll_after -= logq.gather(1, targets).sum().item()
            kl += (logp.exp() * (logp - logq)).sum().item()
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            count += len(window) - 1
            progress.window_done()
        ppl_before, ppl_after = math.exp(nll_before / count), math.exp(nll_after / count)
        return {
            "ppl_before": round(ppl_before, 4),
            "ppl_after": round(ppl_after, 4),
            "ppl_increase_pct": round(100 * (ppl_after / ppl_before - 1), 3),
            "kl": round(kl / count, 5),
            "top1_agreement": round(agree / count, 5),
            "tokens": count,
        }


class _Progress:
    """`quality: i/n windows` lines: at the start, every PROGRESS_EVERY_S, and at the end."""

    def __init__(self, log: Callable[[str], None] | None, total: int, seq_len: int):
        self.log, self.total, self.done = log, total, 0
        self.started = self.last = time.perf_counter()
        if log is not None:
            log(f"      quality: measuring {total} windows of {seq_len} tokens "
                "(the pass's input and output models)")

    def window_done(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.log is not None and (self.done == self.total
                                     or now - self.last >= PROGRESS_EVERY_S):
            self.log(f"      quality: {self.done}/{self.total} windows, "
                     f"{now - self.started:.0f} s")
            self.last = now
