"""What a request gives back: RequestOutput, its metrics, and its text with stop strings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.runtime.logprobs import TokenLogprob
from llmopt.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class SpeculationMetrics:
    num_decode_steps: int  # target steps that gave the request tokens
    num_spec_steps: int  # of those, steps that verified drafts
    num_draft_tokens: int  # drafts verified
    num_accepted_tokens: int  # drafts accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Accepted drafts per speculative step (the step also emits one more token)."""
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None

    def tokens_per_step(self, num_output_tokens: int) -> float | None:
        """Output tokens per target step that gave tokens (1.0 without speculation)."""
        return num_output_tokens / self.num_decode_steps if self.num_decode_steps else None

    def to_dict(self, num_output_tokens: int) -> dict[str, float | int | None]:
        return {
            "decode_steps": self.num_decode_steps,
            "spec_steps": self.num_spec_steps,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": _round(self.acceptance_rate),
            "mean_accepted_length": _round(self.mean_accepted_length),
            "tokens_per_step": _round(self.tokens_per_step(num_output_tokens)),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


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
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # while unfinished: the part that can no longer turn into a stop string
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    metrics: RequestMetrics
    prompt_logprobs: np.ndarray | None = None  # scoring: logprob of token t+1 at t
    logprobs: list[TokenLogprob] | None = None  # per output token, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputText:
    """A request's decoded output, cut before the first stop string.

    While a request runs, the last `len(longest stop) - 1` characters are held back from
    `visible_text`: they might be the start of a stop string, which must never reach a
    stream.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped = False  # a stop string was found; text ends before it

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Decode new tokens; True when a stop string has appeared."""
        if self.stopped:
            return True
        delta = self.detokenizer.add_tokens(token_ids)
        # A stop string can only start within the last holdback characters of the old text.
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        return bool(delta) and self._cut_at_stop(search_from)

    def finish(self) -> None:
        """Decode what an incomplete final character held back."""
        if not self.stopped:
            search_from = max(0, len(self.text) - self.holdback)
            self.text += self.detokenizer.flush()
            self._cut_at_stop(search_from)

    def visible_text(self, finished: bool) -> str:
        if finished or self.stopped:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped
