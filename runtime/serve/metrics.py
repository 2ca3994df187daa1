"""ServerMetrics: the Prometheus series `GET /metrics` exposes (names follow vLLM's).

Each server has its own registry, so several servers in one process (tests) never clash.
Token timings are taken on the engine thread, the moment a step produces the tokens.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmopt.runtime.output import RequestOutput

PREFIX = "llmopt"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class TokenTimes(Protocol):
    """What the metrics read and keep of a request's stream (the engine loop's request)."""

    arrival_time: float
    num_tokens_seen: int
    last_token_time: float


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, list(labels),
                         registry=self.registry).labels(**labels)

        self.requests = counter("requests", "Finished requests by outcome "
                                "(stop, length, abort, error, rejected)", ("outcome",))
        self._labels = labels
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests"
                                     ).labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens").labels(**labels)
        self.prefix_cache_hit_tokens = counter(
            "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"
        ).labels(**labels)
        self.draft_tokens = counter("spec_decode_draft_tokens", "Draft tokens verified"
                                    ).labels(**labels)
        self.accepted_tokens = counter("spec_decode_accepted_tokens", "Draft tokens accepted"
                                       ).labels(**labels)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Arrival to first generated token", list(labels),
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between generated tokens of a request", list(labels),
                             buckets=ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV pool blocks in use")
        self.kv_usage = gauge("kv_cache_usage_ratio", "Used / usable KV pool blocks")

    def request_finished(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def observe_tokens(self, request: TokenTimes, output: RequestOutput, now: float) -> None:
        """TTFT on a request's first tokens, inter-token latency on later ones (a step that
        gives k tokens, with speculation, counts as k gaps of 1/k of the time)."""
        new = len(output.token_ids) - request.num_tokens_seen
        if new <= 0:
            return
        if request.num_tokens_seen == 0:
            self.ttft.observe(now - request.arrival_time)
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.prefix_cache_hit_tokens.inc(output.metrics.num_cached_tokens)
        else:
            gap = (now - request.last_token_time) / new
            for _ in range(new):
                self.itl.observe(gap)
        self.generation_tokens.inc(new)
        request.num_tokens_seen = len(output.token_ids)
        request.last_token_time = now

    def request_done(self, output: RequestOutput) -> None:
        self.request_finished(output.finish_reason or "error")
        spec = output.metrics.speculation
        if spec is not None and spec.num_draft_tokens:
            self.draft_tokens.inc(spec.num_draft_tokens)
            self.accepted_tokens.inc(spec.num_accepted_tokens)

    def set_state(self, running: int, waiting: int, used_blocks: int, usable_blocks: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used_blocks.set(used_blocks)
        self.kv_usage.set(used_blocks / usable_blocks if usable_blocks else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
