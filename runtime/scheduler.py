"""Scheduler: continuous batching with one rule.

Each request's `num_computed_tokens` catches up with its known tokens (prompt + output).
A step gives every scheduled request some tokens to compute, within a per-step token
budget: a decode is one token, a prefill is chunked to what the budget leaves, and
prefill and decode are not separate modes. Running requests go first, in admission
order; then waiting ones are admitted. When KV blocks run out, the most recently
admitted running request is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue with its output tokens kept as known tokens,
so recomputing them continues exactly where it stopped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # per-step token budget
    max_context: int  # most known tokens (prompt + output) a request may reach

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from position request.num_computed_tokens


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        eos_token_ids: Iterable[int] = (),
    ):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        check_prompt_length(request.num_prompt_tokens, self.config.max_context, request.score_only)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions = self.num_preemptions

        # Running requests first: they hold blocks already, and decodes keep latency low.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_tokens):
                break  # it preempted itself: every request after it is gone too
            scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
            i += 1

        # Then admit waiting requests, unless blocks just ran out.
        if self.num_preemptions == num_preemptions:
            scheduled += self._admit_waiting(budget)
        return scheduled

    def _allocate_or_preempt(self, request: Request, num_tokens: int) -> bool:
        """Allocate slots, preempting the latest admitted requests until they fit.

        False when `request` itself had to be preempted.
        """
        while not self.kv_cache_manager.allocate_slots(request, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Move waiting requests to running, in order, while tokens, seats and blocks last."""
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_tokens = min(request.num_tokens - num_cached_tokens, budget)
            if not self.kv_cache_manager.allocate_slots(request, num_tokens, computed_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = request.num_cached_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
        return admitted

    def update_from_output(
        self, scheduled: list[ScheduledRequest], sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that stop.

        `sampled_token_ids` holds a token for each request that caught up this step.
        Returns the requests that received a new token.
        """
        updated = []
        for item in scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            self.kv_cache_manager.cache_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: more known tokens to compute
            if request.score_only:
                self.finish_request(request, "length")
                continue
            request.append_output_token(sampled_token_ids[request.request_id])
            updated.append(request)
            reason = self._token_stop_reason(request)
            if reason is not None:
                self.finish_request(request, reason)
        return updated

    def finish_request(self, request: Request, reason: str) -> None:
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _token_stop_reason(self, request: Request) -> str | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if last in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.config.max_context:
            return "length"
        return None


def check_prompt_length(num_prompt_tokens: int, max_context: int, score_only: bool) -> None:
    """A prompt must fit the context, leaving room for one output token unless only scored."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    limit = max_context if score_only else max_context - 1
    if num_prompt_tokens > limit:
        room = "" if score_only else " (one position is kept for the first output token)"
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens but the max context is {max_context} "
            f"tokens, so prompts may have at most {limit}{room}"
        )
