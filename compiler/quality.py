"""What a lossy pass costs: perplexity, KL divergence and top-1 agreement against the IR
it started from, on held-out text (the recipe's `quality.eval_text`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.compiler.ir import ModelIR
from llmopt.compiler.reference import ReferenceModel
from llmopt.runtime.evaluate import windows_of


@dataclass(frozen=True)
class QualityProbe:
    windows: list[list[int]]  # token windows of held-out text

    @classmethod
    def from_text(cls, ir: ModelIR, text_file: str | Path, windows: int,
                  seq_len: int) -> QualityProbe:
        return cls(windows_of(ir.text_token_ids(text_file), seq_len, windows,
                              source=f"quality.eval_text {text_file}"))

    @torch.no_grad()
    def compare(self, before: ModelIR, after: ModelIR) -> dict[str, float]:
        """Next-token quality of `after` relative to `before`, window by window."""
        ref, new = ReferenceModel(before, len(self.windows[0])), ReferenceModel(after,
                                                                                len(self.windows[0]))
        nll_before = nll_after = kl = agree = 0.0
        count = 0
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
        ppl_before, ppl_after = math.exp(nll_before / count), math.exp(nll_after / count)
        return {
            "ppl_before": round(ppl_before, 4),
            "ppl_after": round(ppl_after, 4),
            "ppl_increase_pct": round(100 * (ppl_after / ppl_before - 1), 3),
            "kl": round(kl / count, 5),
            "top1_agreement": round(agree / count, 5),
            "tokens": count,
        }
