"""Perplexity of an artifact, computed by the runtime executing it.

Protocol (shared/data/README.md): tokenize the whole text once without BOS, take the
first `windows` non-overlapping windows of `seq_len` tokens, predict every token of a
window from the ones before it, report exp(mean NLL).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmopt.runtime.texts import read_text, windows_of

if TYPE_CHECKING:
    from llmopt.runtime.llm import LLM


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token
    tokens: int  # predicted tokens
    windows: int
    seq_len: int
    seconds: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def perplexity(llm: LLM, text_file: str | Path, windows: int = 64,
               seq_len: int = 512) -> PerplexityResult:
    text = read_text(text_file)
    token_ids = llm.tokenizer.encode(text, add_bos=False, add_eos=False)  # plain text
    started = time.perf_counter()
    chunks = windows_of(token_ids, seq_len, windows)
    nll_sum, count = 0.0, 0
    for window in chunks:
        logprobs = llm.score(window)
        nll_sum -= float(np.sum(logprobs, dtype=np.float64))
        count += len(logprobs)
    nll = nll_sum / count
    return PerplexityResult(math.exp(nll), nll, count, len(chunks), seq_len,
                            time.perf_counter() - started)
