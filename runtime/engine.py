"""LLMEngine: the step loop tying scheduler, KV cache manager, executor and sampler together.

One step: schedule -> draft (when speculating) -> build the StepBatch -> execute ->
sample the rows that caught up with their known tokens, verifying their drafts (and
record logprobs of scored ones) -> append tokens and stop requests on eos, stop tokens,
stop strings, max_tokens or max context -> free what finished. Requests join and leave
between steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from llmopt.runtime.drafter import Drafter
from llmopt.runtime.kv_cache_manager import KVCacheManager, cdiv
from llmopt.runtime.logprobs import token_logprobs
from llmopt.runtime.output import OutputText, RequestMetrics, RequestOutput, SpeculationMetrics
from llmopt.runtime.rejection_sampler import verify_drafts
from llmopt.runtime.request import Request
from llmopt.runtime.sampler import log_softmax, sample
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from llmopt.runtime.speculation_governor import SpeculationGovernor
from llmopt.runtime.speculation_policy import SpeculationPolicy
from llmopt.runtime.step_batch import Executor, logits_offsets, make_step_batch
from llmopt.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    block_size: int
    num_blocks: int  # including the reserved null block 0
    max_num_seqs: int
    max_num_batched_tokens: int
    max_context: int
    enable_prefix_caching: bool = True
    num_speculative_tokens: int = 0  # γ; 0 = no speculation
    speculative_max_batch_size: int | None = None  # speculation off above; None = never

    def __post_init__(self) -> None:
        check_pool_size(self.num_blocks, self.block_size, self.max_context)


def check_pool_size(num_blocks: int, block_size: int, max_context: int) -> None:
    """The pool must hold at least one max-context sequence, or a lone request could stall."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    needed = cdiv(max_context, block_size)
    if num_blocks - 1 < needed:
        raise ValueError(
            f"the KV pool has {num_blocks} blocks ({max(num_blocks - 1, 0)} usable: block 0 is "
            f"reserved) but one sequence of max_context={max_context} tokens needs {needed} "
            f"blocks of {block_size} tokens; raise num_blocks or lower max_context"
        )


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Tokenizer | None = None,
        kv_cache_manager: KVCacheManager | None = None,
        drafter: Drafter | None = None,
        speculation_policy: SpeculationPolicy | None = None,
        speculation_governor: SpeculationGovernor | None = None,
    ):
        """`drafter` proposes draft tokens when `config.num_speculative_tokens` > 0; a
        model drafter shares the engine's `kv_cache_manager` (its block tables).
        `speculation_policy` sizes each sequence's drafts from its acceptance and their
        cost (None: always γ); `speculation_governor` prices drafts for it from the
        engine's own step timings at the running batch size (None: the manifest's
        prices)."""
        if config.num_speculative_tokens and drafter is None:
            raise ValueError("num_speculative_tokens > 0 needs a drafter")
        self.executor = executor
        self.config = config
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.kv_cache_manager = kv_cache_manager or KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        scheduler_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_context,
            config.num_speculative_tokens, config.speculative_max_batch_size,
        )
        self.speculation_policy = speculation_policy
        self.speculation_governor = speculation_governor
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, eos_token_ids,
                                   speculation_policy)
        self.requests: dict[str, Request] = {}  # unfinished ones
        self.prompts: dict[str, str | None] = {}
        self.texts: dict[str, OutputText] = {}
        self.draft_probs: dict[str, np.ndarray | None] = {}  # this step's, per request
        self._ids = itertools.count()

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        score_only: bool = False,
    ) -> str:
        """Queue a request; it is scheduled from the next step on. Returns its id."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request = Request(str(next(self._ids)), list(prompt_token_ids), params, score_only)
        self.scheduler.add_request(request)  # raises on a prompt too long for the context
        self.requests[request.request_id] = request
        self.prompts[request.request_id] = prompt
        if self.tokenizer is not None:
            self.texts[request.request_id] = OutputText(self.tokenizer, params.stop)
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish_request(request, "abort")
            self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs for every request that got a token or finished."""
        self._price_speculation()
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        pure_decode = all(not item.request.score_only and item.num_tokens
                          - item.num_spec_tokens == 1 for item in scheduled)
        drafting_started = time.perf_counter()
        scheduled = self._propose_drafts(scheduled)
        draft_seconds = time.perf_counter() - drafting_started
        logits = self.executor.execute(make_step_batch(scheduled, self.kv_cache_manager))
        emitted = self._process_logits(scheduled, logits)
        if self.speculation_governor is not None and pure_decode:
            self.speculation_governor.record(
                [item.num_spec_tokens for item in scheduled],
                time.perf_counter() - started - draft_seconds, draft_seconds)
        updated = self.scheduler.update_from_output(scheduled, emitted, self._hit_stop_string)
        changed = {r.request_id: r for r in updated}
        for item in scheduled:
            if item.request.is_finished:
                changed[item.request.request_id] = item.request
        for request in changed.values():
            text = self.texts.get(request.request_id)
            if text is not None and request.is_finished:
                text.finish()
        return [self._make_output(request) for request in changed.values()]

    def _price_speculation(self) -> None:
        """Let the governor gate this step and price its drafts for the policy."""
        governor = self.speculation_governor
        if governor is None:
            return
        batch_size = len(self.scheduler.running)
        self.scheduler.speculation_allowed = governor.allows(batch_size)
        if self.speculation_policy is not None:
            prices = governor.prices(batch_size)
            self.speculation_policy.set_prices(prices.cost_scale, prices.draft_cost)

    def _propose_drafts(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Fill the draft slots the scheduler reserved; give back the ones left unused."""
        speculating = [i for i, item in enumerate(scheduled) if item.num_spec_tokens]
        if not speculating:
            return scheduled
        requests = [scheduled[i].request for i in speculating]
        policy = self.speculation_policy  # prices each source's drafts before they are made
        proposals = self.drafter.propose(
            requests, [scheduled[i].num_spec_tokens for i in speculating],
            policy.num_drafts if policy is not None else None)
        scheduled = list(scheduled)
        for i, request, proposal in zip(speculating, requests, proposals, strict=True):
            request.spec_token_ids = list(proposal.token_ids)
            request.spec_source = proposal.source
            if proposal.token_ids:  # popped when they are verified, later in this step
                self.draft_probs[request.request_id] = proposal.probs
            unused = scheduled[i].num_spec_tokens - len(proposal.token_ids)
            scheduled[i] = dataclasses.replace(
                scheduled[i], num_tokens=scheduled[i].num_tokens - unused,
                num_spec_tokens=len(proposal.token_ids))
        return scheduled

    def _process_logits(
        self, scheduled: list[ScheduledRequest], logits: np.ndarray
    ) -> dict[str, list[int]]:
        """The tokens each request that caught up emits; logprobs of scored ones recorded.

        Requests without drafts are sampled together, one token each; a request with
        drafts gets its accepted drafts plus one (`verify_drafts`).
        """
        emitted: dict[str, list[int]] = {}
        to_sample: list[Request] = []
        sample_rows: list[int] = []
        row = 0
        for item in scheduled:
            request, num_rows = item.request, len(logits_offsets(item))
            if request.score_only:
                record_prompt_logprobs(item, logits[row : row + num_rows])
            elif request.spec_token_ids:
                emitted[request.request_id] = self._verify(request, logits[row : row + num_rows])
            elif num_rows:
                to_sample.append(request)
                sample_rows.append(row)
            row += num_rows
        if to_sample:
            token_ids = sample(
                logits[sample_rows],
                [r.sampling_params for r in to_sample],
                [r.generator for r in to_sample],
                [r.all_token_ids for r in to_sample],
            )
            for request, token, row in zip(to_sample, token_ids, sample_rows, strict=True):
                emitted[request.request_id] = [int(token)]
                _record_logprobs(request, logits[row : row + 1], [int(token)])
        for request_id, tokens in emitted.items():
            request = self.requests[request_id]
            request.num_decode_steps += 1
            if self.speculation_policy is not None:
                num_drafts = len(request.spec_token_ids)
                self.speculation_policy.observe(request, request.spec_source, num_drafts,
                                                min(len(tokens) - 1, num_drafts))
        return emitted

    def _verify(self, request: Request, logits: np.ndarray) -> list[int]:
        drafts = request.spec_token_ids
        tokens = verify_drafts(logits, drafts, self.draft_probs.pop(request.request_id, None),
                               request.sampling_params, request.generator, request.all_token_ids)
        request.num_spec_steps += 1
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += len(tokens) - 1
        _record_logprobs(request, logits, tokens)  # row j of the verified rows gave token j
        return tokens

    def _hit_stop_string(self, request: Request) -> bool:
        """Decode the request's newest token; True when a stop string has appeared."""
        text = self.texts.get(request.request_id)
        return text is not None and text.add_tokens(request.output_token_ids[-1:])

    def _make_output(self, request: Request) -> RequestOutput:
        text = self.texts.get(request.request_id)
        output = RequestOutput(
            request_id=request.request_id,
            prompt=self.prompts[request.request_id],
            prompt_token_ids=request.prompt_token_ids,
            text=text.visible_text(request.is_finished) if text else "",
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            metrics=RequestMetrics(
                request.arrival_time,
                request.first_token_time,
                request.finished_time,
                request.num_preemptions,
                request.num_cached_tokens,
                SpeculationMetrics(
                    request.num_decode_steps,
                    request.num_spec_steps,
                    request.num_draft_tokens,
                    request.num_accepted_tokens,
                ),
            ),
            prompt_logprobs=request.prompt_logprobs,
            logprobs=(list(request.output_logprobs)
                      if request.sampling_params.logprobs is not None else None),
        )
        if request.is_finished:
            self.requests.pop(request.request_id, None)
            self._forget(request.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.texts.pop(request_id, None)


def _record_logprobs(request: Request, logits: np.ndarray, tokens: list[int]) -> None:
    """Logprobs of a request's emitted tokens, if it asked for them."""
    if request.sampling_params.logprobs is not None:
        request.output_logprobs += token_logprobs(logits, tokens, request.sampling_params.logprobs)


def record_prompt_logprobs(item: ScheduledRequest, logits: np.ndarray) -> None:
    """Store logprob of token t+1 at each scored position t; one chunk bounds the memory."""
    request, start = item.request, item.request.num_computed_tokens
    num_rows = logits.shape[0]
    if num_rows == 0:
        return
    targets = np.asarray(request.all_token_ids[start + 1 : start + 1 + num_rows])
    logprobs = log_softmax(logits)[np.arange(num_rows), targets]
    request.prompt_logprobs[start : start + num_rows] = logprobs
