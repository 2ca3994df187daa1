"""Throughput and latency of an artifact: TTFT, per-stream decode speed, aggregate speed."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass

import numpy as np

from llmopt.runtime.llm import LLM
from llmopt.runtime.output import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.speculative.metrics import total_speculation
from llmopt.tools.bench_text import text_prompts


@dataclass(frozen=True)
class BenchResult:
    batch: int
    prompt_len: int
    gen_len: int
    ttft_ms: float  # mean time from submission to first token (prefill of the whole batch)
    decode_tok_s_per_stream: float  # mean over requests, after their first token
    aggregate_tok_s: float  # generated tokens of all streams / wall time
    # Tokens per second once every stream has its first token (from then on every step
    # only decodes): the decode phase's aggregate, free of the prompts' prefill chunks that
    # early streams' per-stream speeds include under continuous batching.
    decode_aggregate_tok_s: float
    wall_s: float
    peak_rss_mib: float  # of this process so far
    # Speculation, over all requests (None without it): accepted / verified drafts,
    # accepted drafts per speculative step, output tokens per target step.
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    tokens_per_step: float | None = None
    prompts: str = "random"  # PROMPT_KINDS: what the prompts were

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


PROMPT_KINDS = ("text", "random")  # bench_text's passages, or random token ids


def prompt_kind(requested: str, speculates: bool) -> str:
    """"auto": text when the artifact speculates (random ids flatter every draft: a model
    fed noise repeats itself), random otherwise (no tokenizer work, any vocabulary)."""
    if requested != "auto":
        return requested
    return "text" if speculates else "random"


def bench_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Distinct random prompts so the prefix cache cannot share anything between them."""
    rng = np.random.default_rng(seed)
    low = min(1000, vocab_size // 4)
    return [rng.integers(low, vocab_size, prompt_len).tolist() for _ in range(batch)]


def run_bench(llm: LLM, batch: int, prompt_len: int, gen_len: int, seed: int = 0,
              prompts_kind: str = "random") -> BenchResult:
    if prompts_kind not in PROMPT_KINDS:
        raise ValueError(f"bench prompts are one of {PROMPT_KINDS}, not {prompts_kind!r}")
    if prompts_kind == "text":
        prompts = text_prompts(llm.tokenizer, batch, prompt_len)
    else:
        prompts = bench_prompts(llm.manifest.model.vocab_size, batch, prompt_len, seed)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs, window = generate_timed(llm, prompts, params)
    wall = time.perf_counter() - started
    ttft, per_stream = [], []
    for out in outputs:
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        decode_time = m.finished_time - m.first_token_time
        per_stream.append((len(out.token_ids) - 1) / decode_time if decode_time > 0 else 0.0)
    generated = sum(len(o.token_ids) for o in outputs)
    speculation = total_speculation(o.metrics.speculation for o in outputs)
    return BenchResult(
        batch=batch, prompt_len=prompt_len, gen_len=gen_len,
        ttft_ms=1000 * float(np.mean(ttft)),
        decode_tok_s_per_stream=float(np.mean(per_stream)),
        aggregate_tok_s=generated / wall,
        decode_aggregate_tok_s=window.tokens / window.seconds if window.seconds > 0 else 0.0,
        wall_s=wall, peak_rss_mib=peak_rss_mib(),
        acceptance_rate=speculation.acceptance_rate if speculation else None,
        mean_accepted_length=speculation.mean_accepted_length if speculation else None,
        tokens_per_step=speculation.tokens_per_step(generated) if speculation else None,
        prompts=prompts_kind,
    )


@dataclass(frozen=True)
class DecodeWindow:
    """What followed the step that gave the last stream its first token."""

    tokens: int
    seconds: float


def generate_timed(llm: LLM, prompts: list[list[int]], params: SamplingParams
                   ) -> tuple[list[RequestOutput], DecodeWindow]:
    """`llm.generate(prompts, params)` step by step: the outputs in prompt order, and the
    tokens and seconds after the last stream's first token."""
    engine = llm.engine
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    latest: dict[str, RequestOutput] = {}
    opened, tokens_before = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            latest[output.request_id] = output
        if opened is None and len(latest) == len(ids) and all(
                o.token_ids for o in latest.values()):
            opened = time.perf_counter()
            tokens_before = sum(len(o.token_ids) for o in latest.values())
    generated = sum(len(o.token_ids) for o in latest.values())
    seconds = time.perf_counter() - opened if opened is not None else 0.0
    return [latest[i] for i in ids], DecodeWindow(generated - tokens_before, seconds)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
