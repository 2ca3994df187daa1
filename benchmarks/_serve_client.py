"""A load generator for OpenAI-compatible servers: streamed completions over raw HTTP,
open-loop Poisson arrivals, and the server process it drives (shared by bench_serve.py
and soak_serve.py).

The client is deliberately thin (httpx + hand-parsed server-sent events) so it costs
the same next to every server it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np


@dataclass
class StreamResult:
    ok: bool
    error: str | None = None
    cancelled: bool = False  # closed by the client on purpose, mid-stream
    send_time: float = 0.0
    first_token_time: float | None = None
    end_time: float = 0.0
    num_tokens: int = 0  # from the usage chunk, else one per content chunk
    text: str = ""
    finish_reason: str | None = None
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def itl(self) -> float | None:
        """Mean seconds per output token after the first (TPOT)."""
        if self.first_token_time is None or self.num_tokens < 2:
            return None
        return (self.end_time - self.first_token_time) / (self.num_tokens - 1)


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            cancel_after_chunks: int | None = None) -> StreamResult:
    """POST a streamed completion; `cancel_after_chunks` closes the stream after that many
    content chunks (a client that gives up)."""
    result = StreamResult(ok=False, send_time=time.perf_counter())
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.ok = True
                    break
                chunks += _apply_chunk(result, json.loads(line[6:]))
                if cancel_after_chunks is not None and chunks >= cancel_after_chunks:
                    result.cancelled = True
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_time = time.perf_counter()
    return result


def _apply_chunk(result: StreamResult, chunk: dict[str, Any]) -> int:
    """Fold one SSE chunk into the result; 1 if it carried text."""
    if "error" in chunk:
        raise httpx.HTTPError(str(chunk["error"]))
    if chunk.get("usage"):
        result.num_tokens = chunk["usage"]["completion_tokens"]
    carried = 0
    for choice in chunk.get("choices") or ():
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text:
            now = time.perf_counter()
            result.first_token_time = result.first_token_time or now
            result.chunk_times.append(now)
            result.text += text
            carried = 1
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return carried


async def open_loop(url: str, bodies: list[dict[str, Any]], rate: float, seed: int,
                    timeout_s: float = 600.0) -> tuple[list[StreamResult], float]:
    """Send `bodies` at Poisson arrivals of `rate` per second, whatever the server's pace;
    returns the results and the wall time from the first send to the last end."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(bodies))
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        started = time.perf_counter()
        tasks = []
        for body, gap in zip(bodies, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(stream_completion(client, url, body)))
        results = await asyncio.gather(*tasks)
    for r in results:  # servers without a usage chunk: one token per content chunk
        if r.num_tokens == 0:
            r.num_tokens = len(r.chunk_times)
    return list(results), max(r.end_time for r in results) - started


def summarize(results: list[StreamResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [r.itl for r in ok if r.itl is not None]
    tokens = sum(r.num_tokens for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return round(float(np.percentile(values, q)) * 1000, 1) if values else None

    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "output_tokens": tokens, "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(tokens / wall_s, 1) if wall_s else None,
        "request_throughput": round(len(ok) / wall_s, 3) if wall_s else None,
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


class ServerProcess:
    """A server command run until the block ends (SIGTERM, then SIGKILL after 30 s)."""

    def __init__(self, command: list[str], health_url: str, log: Path,
                 env: dict[str, str] | None = None, startup_s: float = 300.0):
        self.command, self.health_url, self.log = command, health_url, log
        self.env, self.startup_s = env, startup_s
        self.process: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def __enter__(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as log:
            # its own process group: servers that fork workers (vLLM) end with them
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited; see {self.log}")
            try:
                if httpx.get(self.health_url, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.command[0]} did not become healthy; see {self.log}")

    def rss_mib(self) -> float:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.exit_code = self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.exit_code = self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # workers that outlived their parent
            os.killpg(self.process.pid, signal.SIGKILL)
