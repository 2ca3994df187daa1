"""Request: one sequence's tokens, progress and outcome, as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmopt.runtime.kv.block_pool import BlockHash
from llmopt.runtime.logprobs import TokenLogprob
from llmopt.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Known tokens are the prompt plus every accepted output token.

    The scheduler's one rule: `num_computed_tokens` (tokens whose KV is in the pool)
    catches up with `num_tokens`. When it does, the step's logits for the last known
    token give the next one.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    score_only: bool = False  # compute logprobs of the prompt's tokens, never sample
    arrival_time: float = field(default_factory=time.monotonic)

    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    finish_reason: str | None = field(init=False, default=None)  # "stop" | "length" | "abort"
    num_preemptions: int = field(init=False, default=0)
    num_cached_tokens: int = field(init=False, default=0)  # prefix-cache hit at last admission
    first_token_time: float | None = field(init=False, default=None)
    finished_time: float | None = field(init=False, default=None)
    # Chained hashes of the full blocks of known tokens, extended as tokens arrive.
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    # score_only: logprob of token t+1 given tokens 0..t, filled as positions are computed.
    prompt_logprobs: np.ndarray | None = field(init=False, default=None)
    generator: np.random.Generator = field(init=False)
    num_decode_steps: int = field(init=False, default=0)  # steps that gave it tokens
    # With sampling_params.logprobs set: one entry per output token.
    output_logprobs: list[TokenLogprob] = field(init=False, default_factory=list)
    # With sampling_params.structured_outputs: its llguidance matcher, at the state after
    # the output so far (runtime/structured/).
    grammar: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.generator = np.random.default_rng(self.sampling_params.seed)
        if self.score_only:
            self.prompt_logprobs = np.zeros(self.num_prompt_tokens - 1, dtype=np.float32)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
