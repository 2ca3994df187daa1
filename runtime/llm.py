"""LLM: the user-facing entry point over a compiled artifact directory."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.assembly import EngineOptions, build_engine
from llmopt.runtime.executors.choose import kernels_name
from llmopt.runtime.kv.h2o import H2OConfig
from llmopt.runtime.kv.streaming import StreamingConfig
from llmopt.runtime.output import RequestOutput
from llmopt.runtime.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from llmopt.runtime.scheduler import check_prompt_length
from llmopt.runtime.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Generate, stream and score with an artifact: `LLM("out/smollm2").generate("Hi")`.

    Arguments left as None take the manifest's runtime defaults. An artifact compiled
    with a draft speculates unless `speculative=False`; `num_speculative_tokens` and
    `speculative_max_batch_size` override the γ and batch-size limit the compiler chose.
    With the compiler's step costs in the manifest, each sequence drafts only as many
    tokens as pay for themselves: its recent acceptance per draft source, against the
    step prices the compiler measured, at the running batch size
    (`adaptive_speculation=False`: always γ, wherever the batch-size limit allows).
    `drafts` picks which of the artifact's drafts run: "all", "ngram" or "model".
    `draft_tree=True` makes a suffix n-gram draft propose trees (several candidates per
    position, verified in one step under a tree mask; the native step runs them).
    `streaming=StreamingConfig(sinks, window)` keeps each request's first `sinks` and last
    `window` positions, so generation runs past the context in fixed memory (lanes; no
    speculation, no prefix caching; see `kv.streaming`); `streaming=H2OConfig(budget)`
    keeps heavy hitters by accumulated attention and a recent window instead (the native
    step, or ONNX Runtime on an artifact compiled with `runtime: h2o`; `kv.h2o`); None
    takes the recipe's `runtime: streaming:` or `h2o:`, False turns it off.
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
        draft_tree: bool = False,
        kernels: str = "auto",
        streaming: StreamingConfig | H2OConfig | bool | None = None,
    ):
        self.path = Path(path)
        self.num_threads = num_threads
        self.manifest = manifest = load_manifest(self.path)
        self.tokenizer = Tokenizer.from_file(
            self.path / manifest.tokenizer.file, manifest.tokenizer
        )
        options = EngineOptions(
            num_threads=num_threads, block_size=block_size, num_blocks=num_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_context=max_context, enable_prefix_caching=enable_prefix_caching,
            optimization_level=optimization_level, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
            speculative_max_batch_size=speculative_max_batch_size,
            adaptive_speculation=adaptive_speculation, drafts=drafts, draft_tree=draft_tree,
            kernels=kernels, streaming=streaming,
        )
        self.engine = build_engine(self.path, manifest, self.tokenizer, options)
        # The checkpoint's generation config, with max_new_tokens (when it has none) as the
        # CLI's: generate(prompt) and `llmopt generate OUT prompt` stop at the same length.
        self.default_params = SamplingParams.from_generation_config(
            {"max_new_tokens": DEFAULT_MAX_TOKENS, **_without_none(manifest.generation)})

    def kernels_in_use(self) -> str:
        """Which kernels run the target graph: llmopt's native step or ONNX Runtime."""
        if kernels_name(self.engine.executor) == "native":
            return "native (llmopt's decoder step, runtime/native)"
        return "onnxruntime"

    def threads_in_use(self) -> str:
        """The target's intra-op threads, and whether they were asked for or the default."""
        if self.num_threads is not None:
            return str(self.num_threads)
        if kernels_name(self.engine.executor) == "native":
            return f"{os.cpu_count() or 1} (all cores)"
        return "ONNX Runtime's default (one per physical core)"

    def execution_summary(self) -> str:
        """One line for logs: which kernels run the target and on how many threads."""
        return f"kernels: {self.kernels_in_use()}; threads: {self.threads_in_use()}"

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
            check_prompt_length(len(token_ids), self.engine.config.max_request_tokens, False)
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
        if len(token_ids) < 2:
            raise ValueError(f"score needs at least 2 token ids (the first has no "
                             f"prediction), got {len(token_ids)}")
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


def _without_none(config: dict) -> dict:
    return {key: value for key, value in config.items() if value is not None}


def _is_single_prompt(prompts: Prompt | Sequence[Prompt]) -> bool:
    """Text, or one list of token ids (rather than a list of prompts)."""
    if isinstance(prompts, str):
        return True
    return len(prompts) > 0 and all(isinstance(t, int | np.integer) for t in prompts)
