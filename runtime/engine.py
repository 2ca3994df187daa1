"""LLMEngine: the step loop tying scheduler, KV cache manager, executor and sampler together.

One step: schedule -> run -> postprocess. Schedule picks the requests and their token
counts (with a speculator: each decoding request's draft slots, filled by its drafter
before the step runs). Run builds the StepBatch and executes it. Postprocess samples the
rows that caught up with their known tokens (verifying drafts, recording logprobs of
scored requests), appends tokens, stops requests on eos, stop tokens, stop strings,
max_tokens or max context, and frees what finished. Requests join and leave between
steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from llmopt.runtime.executors.step_batch import (
    Executor,
    SequenceStep,
    StepBatch,
    make_step_batch,
)
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.logprobs import token_logprobs
from llmopt.runtime.output import (
    OutputText,
    RequestMetrics,
    RequestOutput,
    stop_reason,
)
from llmopt.runtime.request import Request
from llmopt.runtime.sampler import log_softmax, sample
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from llmopt.runtime.speculative.constrained import mask_draft_rows, trim_drafts
from llmopt.runtime.speculative.metrics import SpeculationMetrics
from llmopt.runtime.speculative.speculator import SpeculationTotals, Speculator
from llmopt.runtime.structured.manager import StructuredOutputManager
from llmopt.runtime.tokenizer import Tokenizer


@dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulerConfig):
    """The scheduler's limits plus the KV pool's shape."""

    block_size: int
    num_blocks: int  # including the reserved null block 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
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


@dataclass(eq=False)
class _Tracked:
    """What the engine keeps of an unfinished request beside the scheduler's record."""

    request: Request
    prompt: str | None
    text: OutputText | None  # detokenized output and stop strings; None without a tokenizer


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Tokenizer | None = None,
        kv_cache_manager: KVCacheManager | None = None,
        speculator: Speculator | None = None,
    ):
        """`speculator` drafts and verifies tokens for decoding requests (None: plain
        decoding); a model drafter shares the engine's `kv_cache_manager` (its block
        tables)."""
        self.executor = executor
        self.config = config
        self.tokenizer = tokenizer
        self.speculator = speculator
        self.kv_cache_manager = kv_cache_manager or KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.eos_token_ids = list(eos_token_ids)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.eos_token_ids)
        self.requests: dict[str, _Tracked] = {}  # unfinished ones
        self._structured: StructuredOutputManager | None = None  # made on first use
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
        grammar = (self.structured.matcher(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        request = Request(str(next(self._ids)), list(prompt_token_ids), params, score_only)
        request.grammar = grammar
        self.scheduler.add_request(request)  # raises on a prompt too long for the context
        text = (OutputText(self.tokenizer, params.stop, params.include_stop_str_in_output)
                if self.tokenizer is not None else None)
        self.requests[request.request_id] = _Tracked(request, prompt, text)
        return request.request_id

    @property
    def structured(self) -> StructuredOutputManager:
        """Grammars for structured outputs, built for the tokenizer on first use."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer")
            self._structured = StructuredOutputManager(self.tokenizer, self.eos_token_ids)
        return self._structured

    def abort_request(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        if tracked is not None:
            self.scheduler.finish_request(tracked.request, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs for every request that got a token or finished."""
        speculator = self.speculator
        max_drafts = (speculator.max_drafts(len(self.scheduler.running))
                      if speculator is not None else None)
        scheduled = self.scheduler.schedule(max_drafts)
        if not scheduled:
            return []
        if speculator is not None:
            scheduled = speculator.propose(scheduled)
            if self._structured is not None:
                scheduled = trim_drafts(scheduled, speculator.drafts)
        logits = self.executor.execute(self._step_batch(scheduled))
        emitted = self._process_logits(scheduled, logits)
        return self._postprocess(scheduled, emitted)

    def _step_batch(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        kv = self.kv_cache_manager
        return make_step_batch(
            [SequenceStep(item.query_token_ids(), kv.cache_position(item.request),
                          kv.block_ids(item.request), item.logits_offsets(),
                          item.query_parents(), kv.local_block_ids(item.request))
             for item in scheduled],
            kv.block_size)

    def _process_logits(
        self, scheduled: list[ScheduledRequest], logits: np.ndarray
    ) -> dict[str, list[int]]:
        """The tokens each request that caught up emits; logprobs of scored ones recorded.

        Requests without drafts are sampled together, one token each; a request with
        drafts gets its accepted drafts plus one (`Speculator.verify`, which also moves an
        accepted tree branch's entries where its tokens now sit).
        """
        emitted: dict[str, list[int]] = {}
        to_sample: list[Request] = []
        sample_rows: list[int] = []
        row = 0
        for item in scheduled:
            request, num_rows = item.request, len(item.logits_offsets())
            if request.score_only:
                record_prompt_logprobs(item, logits[row : row + num_rows])
            elif item.spec_token_ids:
                rows = logits[row : row + num_rows]
                tokens, used = self.speculator.verify(item, self._masked_drafts(item, rows),
                                                      self.executor, self.kv_cache_manager)
                rows = rows[used]
                emitted[request.request_id] = tokens
                _record_logprobs(request, rows, tokens)  # verified row j gave token j
            elif num_rows:
                to_sample.append(request)
                sample_rows.append(row)
            row += num_rows
        if to_sample:
            first, last = sample_rows[0], sample_rows[-1]
            # a decode step's rows are all sampled, in order: a view, not a 3 MB copy
            rows = (logits[first : last + 1] if last - first + 1 == len(sample_rows)
                    else logits[sample_rows])
            if self._structured is not None:
                rows = self._structured.mask_rows(to_sample, rows)
            token_ids = sample(
                rows,
                [r.sampling_params for r in to_sample],
                [r.generator for r in to_sample],
                [r.all_token_ids for r in to_sample],
            )
            for request, token, row in zip(to_sample, token_ids.tolist(), sample_rows,
                                           strict=True):
                emitted[request.request_id] = [token]
                if request.sampling_params.logprobs is not None:
                    _record_logprobs(request, logits[row : row + 1], [token])
        for request_id, tokens in emitted.items():
            request = self.requests[request_id].request
            request.num_decode_steps += 1
            if request.grammar is not None:
                StructuredOutputManager.accept(request, tokens)
            if self.speculator is not None:
                self.speculator.observe(request, tokens)
        return emitted

    def _masked_drafts(self, item: ScheduledRequest, rows: np.ndarray) -> np.ndarray:
        """A drafting request's rows; a constrained one's masked by its grammar."""
        if item.request.grammar is None or self._structured is None:
            return rows
        return mask_draft_rows(self._structured, item, rows)

    def _postprocess(
        self, scheduled: list[ScheduledRequest], emitted: dict[str, list[int]]
    ) -> list[RequestOutput]:
        """Append the emitted tokens, finish what stopped; an output per changed request."""
        updated = self.scheduler.update_from_output(scheduled, emitted, self._hit_stop_string)
        changed = {r.request_id: r for r in updated}
        for item in scheduled:
            if item.request.is_finished:
                changed[item.request.request_id] = item.request
        outputs = []
        for request in changed.values():
            tracked = self.requests[request.request_id]
            if tracked.text is not None and request.is_finished:
                tracked.text.finish()
            outputs.append(make_output(tracked, self._speculation_metrics(request)))
            if request.is_finished:
                del self.requests[request.request_id]
        return outputs

    def _speculation_metrics(self, request: Request) -> SpeculationMetrics:
        """Its decode steps, and the speculator's counts (zeros without one)."""
        totals = (self.speculator.totals_of(request) if self.speculator is not None
                  else SpeculationTotals())
        return SpeculationMetrics(request.num_decode_steps, totals.num_steps,
                                  totals.num_draft_tokens, totals.num_accepted_tokens)

    def _hit_stop_string(self, request: Request) -> bool:
        """Decode the request's newest token; True when a stop string has appeared."""
        text = self.requests[request.request_id].text
        return text is not None and text.add_tokens(request.output_token_ids[-1:])


def make_output(tracked: _Tracked, speculation: SpeculationMetrics) -> RequestOutput:
    request, text = tracked.request, tracked.text
    return RequestOutput(
        request_id=request.request_id,
        prompt=tracked.prompt,
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
            speculation,
        ),
        prompt_logprobs=request.prompt_logprobs,
        logprobs=(list(request.output_logprobs)
                  if request.sampling_params.logprobs is not None else None),
        stop_reason=stop_reason(request.finish_reason, request.output_token_ids,
                                request.sampling_params.stop_token_ids, text),
    )


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
