"""Scheduler: continuous batching with one rule.

Each request's `num_computed_tokens` catches up with its known tokens (prompt + output).
A step gives every scheduled request some tokens to compute, within a per-step token
budget: a decode is one token, a prefill is chunked to what the budget leaves, and
prefill and decode are not separate modes. Running requests go first, in admission
order; then waiting ones are admitted. When KV blocks run out, the most recently
admitted running request is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue with its output tokens kept as known tokens,
so recomputing them continues exactly where it stopped.

Proposed tokens: when the step's caller passes a budget of extra slots (`max_proposed`), a
running request that is decoding gets up to that many more slots (and budget) for tokens
the caller proposes after its known ones (`spec_token_ids`) before the step runs; the
target computes them with the last known token, and only the ones its output confirms
count as computed afterwards (roll back by length: the other slots are simply
overwritten later, and never reach the prefix cache). A request's extra slots are
dropped before anything is preempted for them.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # per-step token budget
    max_context: int  # most known tokens (prompt + output) a request may reach
    # Requests keep only sinks and a window of their entries (`kv.streaming`), so their
    # length is not bounded by max_context.
    streaming: bool = False

    @property
    def max_request_tokens(self) -> int:
        """Most known tokens a request may reach."""
        return sys.maxsize if self.streaming else self.max_context

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, from position request.num_computed_tokens
    num_spec_tokens: int = 0  # of those, slots for proposed tokens after the known ones
    spec_token_ids: tuple[int, ...] = ()  # the tokens proposed into them
    # Each proposed token's parent among them (-1: the last known token) when they form a
    # tree; None: a chain.
    spec_parents: tuple[int, ...] | None = None

    def query_token_ids(self) -> list[int]:
        """The tokens this step computes: known ones, then the proposed ones."""
        request, start = self.request, self.request.num_computed_tokens
        known_and_proposed = request.all_token_ids + list(self.spec_token_ids)
        return known_and_proposed[start : start + self.num_tokens]

    def query_parents(self) -> list[int] | None:
        """Each query token's parent offset when the proposed tokens are a tree (None: a
        chain): the known tokens continue each other, a proposed one follows its parent."""
        parents = self.spec_parents
        if parents is None or not self.num_spec_tokens:
            return None
        known = self.num_tokens - self.num_spec_tokens
        return (list(range(-1, known - 1))
                + [known + parent if parent >= 0 else known - 1 for parent in parents])

    def logits_offsets(self) -> range:
        """Query offsets whose logits the step needs.

        Its last query row when the step catches it up with its known tokens (that row
        gives the next token), and with proposed tokens the rows of the last known token
        and of every proposed one (the target's distribution after each); every row that
        has a next token when it is scored.
        """
        request, start, n = self.request, self.request.num_computed_tokens, self.num_tokens
        if request.score_only:
            return range(min(n, request.num_tokens - 1 - start))
        num_proposed = len(self.spec_token_ids)
        if start + n == request.num_tokens + num_proposed:
            return range(n - 1 - num_proposed, n)
        return range(0)


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
        check_prompt_length(request.num_prompt_tokens, self.config.max_request_tokens,
                            request.score_only)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(
        self, max_proposed: Callable[[Request], int] | None = None
    ) -> list[ScheduledRequest]:
        """This step's requests and token counts; `max_proposed(request)`: how many slots
        for proposed tokens a decoding request may take (None: none this step)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions = self.num_preemptions

        # Running requests first: they hold blocks already, and decodes keep latency low.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            num_spec = (self._num_spec_tokens(request, budget, max_proposed)
                        if max_proposed else 0)
            if num_spec and self.kv_cache_manager.allocate_slots(request, num_tokens + num_spec):
                scheduled.append(ScheduledRequest(request, num_tokens + num_spec, num_spec))
                budget -= num_tokens + num_spec
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_tokens):
                break  # it preempted itself: every request after it is gone too
            scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
            i += 1

        # Then admit waiting requests, unless blocks just ran out.
        if self.num_preemptions == num_preemptions:
            scheduled += self._admit_waiting(budget)
        return scheduled

    def _num_spec_tokens(self, request: Request, budget: int,
                         max_proposed: Callable[[Request], int]) -> int:
        """Slots for proposed tokens of a decoding request: its budget, within the step's,
        the context and what is left of max_tokens (a token proposed past the last output
        token is wasted)."""
        if request.score_only or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        left = request.sampling_params.max_tokens - len(request.output_token_ids)
        room = self.config.max_request_tokens - request.num_tokens
        return max(0, min(max_proposed(request), budget - 1, room, left - 1))

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
        self,
        scheduled: list[ScheduledRequest],
        sampled_token_ids: dict[str, Sequence[int]],
        stop_check: Callable[[Request], bool] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that stop.

        `sampled_token_ids` holds the tokens each request that caught up emits this step:
        one, or its confirmed proposed tokens plus one. They are appended in order until
        one stops the request; `stop_check(request)` is asked after each (stop strings).
        Returns the requests that received new tokens.
        """
        updated = []
        for item in scheduled:
            request = item.request
            num_proposed = len(item.spec_token_ids)
            emitted = sampled_token_ids.get(request.request_id, ())
            num_confirmed = max(len(emitted) - 1, 0) if num_proposed else 0
            request.num_computed_tokens += item.num_tokens - num_proposed + num_confirmed
            if request.num_computed_tokens < request.num_tokens:
                self.kv_cache_manager.cache_blocks(request)
                continue  # a prefill chunk: more known tokens to compute
            if request.score_only:
                self.kv_cache_manager.cache_blocks(request)
                self.finish_request(request, "length")
                continue
            reason = self._append_tokens(request, emitted, stop_check)
            self.kv_cache_manager.cache_blocks(request)
            updated.append(request)
            if reason is not None:
                self.finish_request(request, reason)
        return updated

    def _append_tokens(
        self, request: Request, token_ids: Sequence[int],
        stop_check: Callable[[Request], bool] | None,
    ) -> str | None:
        """Append tokens until one stops the request; the stop reason, or None."""
        for token in token_ids:
            request.append_output_token(token)
            reason = self._token_stop_reason(request)
            if stop_check is not None and stop_check(request):
                reason = "stop"  # a stop string ends it even on its last allowed token
            if reason is not None:
                # Tokens after the stop are dropped; so is their claim to be computed.
                request.num_computed_tokens = min(request.num_computed_tokens,
                                                  request.num_tokens - 1)
                return reason
        return None

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
        if request.num_tokens >= self.config.max_request_tokens:
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
