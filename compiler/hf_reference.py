"""Measurements of the original transformers model, to compare artifacts against."""

from __future__ import annotations

import math
from typing import Any

import torch

from llmopt.runtime.texts import windows_of


@torch.no_grad()
def hf_perplexity(model: Any, token_ids: list[int], windows: int, seq_len: int
                  ) -> tuple[float, int]:
    """(perplexity, predicted tokens) of a transformers causal LM on the same windows
    `llmopt eval` uses: every token of a window predicted from the ones before it."""
    nll, count = 0.0, 0
    for window in windows_of(token_ids, seq_len, windows):
        logits = model(torch.tensor([window])).logits[0, :-1]
        targets = torch.tensor(window[1:])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
    return math.exp(nll / count), count
