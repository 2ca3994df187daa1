"""What a request gives back: RequestOutput, its metrics, and its text with stop strings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.runtime.logprobs import TokenLogprob
from llmopt.runtime.speculative.metrics import SpeculationMetrics
from llmopt.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    speculation: SpeculationMetrics | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """One request's output so far.

    `token_ids` are every token the request generated, including those that completed a
    stop string or are a stop token, as vLLM returns them: usage and `logprobs` (one per
    token id) count what was sampled. `text` is `decode(token_ids)` cut before the first
    stop string, which `stop_reason` names, or just after it with
    `include_stop_str_in_output`; so `decode(token_ids)` always starts with `text`, and
    the part beyond it starts with `stop_reason`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # while unfinished: the part that can no longer turn into a stop string
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    metrics: RequestMetrics
    prompt_logprobs: np.ndarray | None = None  # scoring: logprob of token t+1 at t
    logprobs: list[TokenLogprob] | None = None  # per output token, when the request asked
    # What stopped it: the stop string (str) or stop token id (int) it met; None for EOS,
    # length, abort, or while running.
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputText:
    """A request's decoded output, cut before the first stop string (after it, with
    `include_stop`).

    While a request runs, the last `len(longest stop) - 1` characters are held back from
    `visible_text`: they might be the start of a stop string, which must never reach a
    stream (nothing is held back when the stop string is shown anyway).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.include_stop = include_stop
        longest = max((len(s) for s in stop), default=1)
        self.holdback = 0 if include_stop else longest - 1
        # A stop string can start this far back in the text decoded before.
        self.overlap = longest - 1
        self.text = ""
        self.stop_string: str | None = None  # the stop string found; text is cut at it

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Decode new tokens; True when a stop string has appeared."""
        if self.stopped:
            return True
        delta = self.detokenizer.add_tokens(token_ids)
        # A stop string can only start within the last `overlap` characters of the old text.
        search_from = max(0, len(self.text) - self.overlap)
        self.text += delta
        return bool(delta) and self._cut_at_stop(search_from)

    def finish(self) -> None:
        """Decode what an incomplete final character held back."""
        if not self.stopped:
            search_from = max(0, len(self.text) - self.overlap)
            self.text += self.detokenizer.flush()
            self._cut_at_stop(search_from)

    def visible_text(self, finished: bool) -> str:
        if finished or self.stopped:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            start, self.stop_string = min(hits, key=lambda hit: hit[0])
            end = start + len(self.stop_string) if self.include_stop else start
            self.text = self.text[:end]
        return self.stopped


def stop_reason(finish_reason: str | None, token_ids: list[int], stop_token_ids: list[int],
                text: OutputText | None) -> str | int | None:
    """The stop string or stop token id that finished a request (None: EOS, length, abort)."""
    if finish_reason != "stop":
        return None
    if text is not None and text.stop_string is not None:
        return text.stop_string
    if token_ids and token_ids[-1] in stop_token_ids:
        return token_ids[-1]
    return None
