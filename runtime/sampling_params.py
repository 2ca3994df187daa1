"""SamplingParams: how one request picks its next tokens and when it stops."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from llmopt.runtime.structured.params import StructuredOutputsParams

# New tokens when neither the caller nor the checkpoint's generation config says: the CLI's
# `--max-tokens` default and `LLM.generate`'s (SamplingParams() itself keeps vLLM's 16).
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; HF semantics over prompt + output tokens
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the text
    include_stop_str_in_output: bool = False  # True: the text ends with the stop string
    stop_token_ids: list[int] = field(default_factory=list)  # kept in the output, like eos
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = each output token's logprob and k best
    # The output must match a JSON schema, regex, choice or grammar (runtime/structured/).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise a single stop string to a list through object.__setattr__.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", [int(t) for t in self.stop_token_ids])
        self._validate()

    def _validate(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(0 <= self.temperature < math.inf,
               f"temperature must be >= 0 and finite, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(self.seed is None or self.seed >= 0, f"seed must be >= 0 or None, got {self.seed}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(self.logprobs is None or self.logprobs >= 0,
               f"logprobs must be >= 0 or None, got {self.logprobs}")
        _check(self.structured_outputs is None or isinstance(
            self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams")
        _check(self.structured_outputs is None or not self.ignore_eos,
               "ignore_eos cannot be combined with structured_outputs: a finished grammar "
               "allows only the end of sequence")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], **overrides: Any) -> SamplingParams:
        """Defaults from an HF-style generation config (the manifest's `generation`)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        if "max_new_tokens" in config and config["max_new_tokens"] is not None:
            kwargs["max_tokens"] = config["max_new_tokens"]
        if config.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        kwargs.update(overrides)
        return cls(**kwargs)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
