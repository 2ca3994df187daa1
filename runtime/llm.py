"""LLM: the user-facing entry point over a compiled artifact directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeGuard

import numpy as np

from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.drafter import Drafter, FallbackDrafter, ModelDrafter, NgramDrafter
from llmopt.runtime.engine import EngineConfig, LLMEngine
from llmopt.runtime.executor import OrtExecutor
from llmopt.runtime.kv_cache_manager import KVCacheManager, cdiv
from llmopt.runtime.manifest import KVCacheSpec, Manifest, SpeculativeSpec
from llmopt.runtime.output import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import check_prompt_length
from llmopt.runtime.speculation_governor import SpeculationGovernor
from llmopt.runtime.speculation_policy import SpeculationPolicy, expected_tokens
from llmopt.runtime.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Generate, stream and score with an artifact: `LLM("out/smollm2").generate("Hi")`.

    Arguments left as None take the manifest's runtime defaults. An artifact compiled
    with a draft speculates unless `speculative=False`; `num_speculative_tokens` and
    `speculative_max_batch_size` override the γ and batch-size limit the compiler chose.
    With the compiler's step costs in the manifest, each sequence drafts only as many
    tokens as pay for themselves: its recent acceptance per draft source, against draft
    prices the engine measures from its own step timings at the running batch size
    (`adaptive_speculation=False`: always γ, wherever the batch-size limit allows).
    `drafts` picks which of the artifact's drafts run: "all", "ngram" or "model".
    """

    def __init__(
        self,
        path: str | Path,
        *,
        num_threads: int | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_context: int | None = None,
        enable_prefix_caching: bool = True,
        optimization_level: str = "all",
        speculative: bool = True,
        num_speculative_tokens: int | None = None,
        speculative_max_batch_size: int | None = None,
        adaptive_speculation: bool = True,
        drafts: str = "all",
    ):
        self.path = Path(path)
        self.manifest = manifest = load_manifest(self.path)
        defaults = manifest.runtime
        block_size = block_size or defaults.block_size
        max_context = max_context or defaults.max_context
        max_num_seqs = max_num_seqs or defaults.max_num_seqs
        if max_context > manifest.model.max_position:
            raise ValueError(
                f"max_context {max_context} exceeds the {manifest.model.max_position} "
                "positions the graph's rotary tables cover"
            )
        if num_blocks is None:
            num_blocks = defaults.num_blocks or max_num_seqs * cdiv(max_context, block_size) + 1
        spec = manifest.speculative if speculative else None
        gamma = num_speculative_tokens if num_speculative_tokens is not None else (
            spec.gamma if spec else 0)
        if gamma and spec is None:
            raise ValueError("num_speculative_tokens > 0 needs an artifact compiled with a draft "
                             "(a `draft` pass) and speculative=True")
        config = EngineConfig(  # checks the pool size before the pool is allocated
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or defaults.max_num_batched_tokens,
            max_context=max_context,
            enable_prefix_caching=enable_prefix_caching,
            num_speculative_tokens=gamma,
            speculative_max_batch_size=(speculative_max_batch_size
                                        if speculative_max_batch_size is not None
                                        else spec.max_batch_size if spec else None),
        )
        self.tokenizer = Tokenizer.from_file(
            self.path / manifest.tokenizer.file, manifest.tokenizer
        )
        def executor_for(graph: str, kv_cache: KVCacheSpec, max_position: int) -> OrtExecutor:
            return OrtExecutor(
                self.path / manifest.graphs[graph].file,
                kv_cache,
                num_blocks=num_blocks,
                block_size=block_size,
                max_position=max_position,
                # The draft runs on the calling thread: a second intra-op pool would spin
                # on the target's cores between steps (measured: the target's steps ran
                # 29 % slower beside a 2-thread draft session on 2 cores).
                num_threads=num_threads if graph == "target" else 1,
                optimization_level=optimization_level,
                nbits_accuracy_level=manifest.graphs[graph].nbits_accuracy_level,
            )

        kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        drafter = None
        if gamma:
            drafter = make_drafter(self.path, manifest, spec, kv_cache_manager, executor_for,
                                   drafts)
        policy = make_policy(spec, gamma) if adaptive_speculation else None
        self.engine = LLMEngine(
            executor_for("target", manifest.kv_cache, manifest.model.max_position),
            config,
            eos_token_ids=manifest.model.eos_token_ids,
            tokenizer=self.tokenizer,
            kv_cache_manager=kv_cache_manager,
            drafter=drafter,
            speculation_policy=policy,
            speculation_governor=make_governor(spec, gamma) if adaptive_speculation else None,
        )
        self.default_params = SamplingParams.from_generation_config(manifest.generation)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order.

        A prompt is text or token ids; with `chat=True` text is the user's message and
        goes through the chat template.
        """
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        param_list = self._params_for(params, len(prompt_list))
        encoded = [self._encode(p, chat) for p in prompt_list]
        for token_ids in encoded:  # check all before queueing any
            check_prompt_length(len(token_ids), self.engine.config.max_context, False)
        request_ids = [
            self.engine.add_request(ids, sp, prompt=p if isinstance(p, str) else None)
            for p, ids, sp in zip(prompt_list, encoded, param_list, strict=True)
        ]
        finished = self._run_until_finished(set(request_ids))
        return [finished[i] for i in request_ids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[str]:
        """Yield text deltas of one request as its tokens arrive."""
        request_id = self.engine.add_request(
            self._encode(prompt, chat),
            params or self.default_params,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        num_yielded = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    if len(output.text) > num_yielded:
                        yield output.text[num_yielded:]
                        num_yielded = len(output.text)
                    if output.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # a no-op once it finished

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len - 1]: log-prob of token t+1 given tokens 0..t, for perplexity.

        The sequence is prefilled in chunks of the step token budget with logits at every
        position, and each chunk is reduced to log-probs before the next one runs.
        """
        request_id = self.engine.add_request(
            self._checked_token_ids(token_ids), SamplingParams(max_tokens=1), score_only=True
        )
        return self._run_until_finished({request_id})[request_id].prompt_logprobs

    def _run_until_finished(self, request_ids: set[str]) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine ran out of requests before these finished")
            for output in self.engine.step():
                if output.finished and output.request_id in request_ids:
                    finished[output.request_id] = output
        return finished

    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if chat:
            raise ValueError("chat=True needs text prompts, not token ids")
        return self._checked_token_ids(prompt)

    def _checked_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """Token ids as ints, each inside the vocabulary (the graph would fail obscurely)."""
        ids = [int(t) for t in token_ids]
        vocab_size = self.manifest.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        return ids

    def _params_for(
        self, params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.default_params] * num_prompts
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        return list(params)


def has_step_costs(spec: SpeculativeSpec | None, gamma: int) -> TypeGuard[SpeculativeSpec]:
    """Did the compiler measure verification costs for every draft length up to γ?"""
    return spec is not None and gamma > 0 and len(spec.verify_cost) >= gamma + 1


def make_policy(spec: SpeculativeSpec | None, gamma: int) -> SpeculationPolicy | None:
    """A per-sequence draft-length policy from the compiler's costs, if it measured them."""
    if not has_step_costs(spec, gamma):
        return None
    prior = equivalent_alpha(spec.acceptance, gamma) if spec.acceptance else 0.5
    return SpeculationPolicy(gamma, spec.verify_cost, spec.cost_ratio or 0.0, prior)


def make_governor(spec: SpeculativeSpec | None, gamma: int) -> SpeculationGovernor | None:
    """Draft prices measured at run time, starting from the compiler's costs."""
    if not has_step_costs(spec, gamma):
        return None
    return SpeculationGovernor(spec.verify_cost, spec.cost_ratio or 0.0)


def equivalent_alpha(acceptance: Sequence[float], gamma: int) -> float:
    """The i.i.d. acceptance rate that yields as many tokens per γ-draft step as the
    compiler's per-position rates (position j accepted given 0..j-1 were); the policy
    models acceptance as i.i.d."""
    rates = (list(acceptance) + [acceptance[-1]] * gamma)[:gamma]
    target = 1.0 + float(np.sum(np.cumprod(rates)))
    low, high = 0.0, 1.0
    for _ in range(40):  # expected_tokens grows with α: bisect
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, gamma) < target else (low, middle)
    return (low + high) / 2


def make_drafter(
    path: Path,
    manifest: Manifest,
    spec: SpeculativeSpec,
    kv_cache_manager: KVCacheManager,
    executor_for: Callable[[str, KVCacheSpec, int], OrtExecutor],
    drafts: str = "all",
) -> Drafter:
    """The artifact's drafter: n-gram lookup, its draft model, or n-gram falling back to it
    (`drafts`: "all" of those it has, only "ngram" or only "model")."""
    if drafts not in ("all", "ngram", "model"):
        raise ValueError(f"drafts must be 'all', 'ngram' or 'model', got {drafts!r}")
    if drafts != "all" and getattr(spec, drafts) is None:
        raise ValueError(f"drafts={drafts!r}, but the artifact has no {drafts} draft")
    model = None
    if spec.model is not None and drafts != "ngram":
        draft = spec.model
        token_map = None
        if draft.token_map is not None:
            token_map = np.load(path / draft.token_map).astype(np.int64)
            if token_map.shape != (draft.vocab_size,):
                raise ValueError(f"the draft's token map {draft.token_map} has shape "
                                 f"{token_map.shape}, expected ({draft.vocab_size},)")
        executor = executor_for(draft.graph, draft.kv_cache, draft.max_position)
        model = ModelDrafter(executor, kv_cache_manager, manifest.model.vocab_size, token_map)
    ngram = spec.ngram and drafts != "model" and NgramDrafter(spec.ngram.min_n,
                                                              spec.ngram.max_n)
    if ngram and model:
        return FallbackDrafter(ngram, model)
    if ngram or model:
        return ngram or model
    raise ValueError("the manifest's speculative section names neither an n-gram nor a "
                     "model draft")


def _is_single_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    """Text, or one list of token ids (rather than a list of prompts)."""
    if isinstance(prompts, str):
        return True
    return len(prompts) > 0 and all(isinstance(t, int | np.integer) for t in prompts)
