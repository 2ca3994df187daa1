"""A small soak on loopback: concurrent streamed clients, some hanging up mid-stream."""

from __future__ import annotations

import asyncio
import json
import random

import httpx2 as httpx
from live_server import MODEL, live_server, metric, wait_for
from toy_artifact import build_artifact, reference_greedy


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
              cancel_after: int | None) -> tuple[list[int], bool]:
    """Token ids streamed back (the toy's words are w<id>), and whether it hung up."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    tokens: list[int] = []
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return tokens, False
            if line.startswith("data: "):
                text = json.loads(line[6:])["choices"][0]["text"]
                tokens += [int(w[1:]) for w in text.split()]
                if cancel_after is not None and len(tokens) >= cancel_after:
                    return tokens, True
    raise AssertionError("the stream ended without [DONE]")


def test_soak_with_cancellations_loses_nothing_and_frees_the_pool(tmp_path):
    rng = random.Random(0)
    jobs = []
    for _ in range(96):
        prompt = [0, *(rng.randrange(3, 64) for _ in range(rng.randint(1, 20)))]
        max_tokens = rng.randint(2, 30)
        cancel = rng.randint(1, max_tokens - 1) if rng.random() < 0.1 else None
        jobs.append((prompt, max_tokens, cancel))

    async def run(base: str) -> list[tuple[list[int], bool]]:
        limits = httpx.Limits(max_connections=24)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, f"{base}/v1/completions", *job)
                                          for job in jobs))

    with live_server(build_artifact(tmp_path)) as (base, srv):
        results = asyncio.run(run(base))
        for (prompt, max_tokens, _), (tokens, cancelled) in zip(jobs, results, strict=True):
            expected = [t for t in reference_greedy(prompt, max_tokens) if t > 2]
            assert tokens == expected[: len(tokens)] if cancelled else tokens == expected
        assert wait_for(lambda: metric(base, "llmopt_kv_cache_used_blocks") == 0)
        assert metric(base, "llmopt_num_requests_running") == 0
        assert metric(base, "llmopt_num_requests_waiting") == 0
        assert srv.in_flight == 0
        assert wait_for(lambda: sum(metric(base, "llmopt_requests_total", outcome=o) for o in
                                    ("stop", "length", "abort")) == len(jobs))
