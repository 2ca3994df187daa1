"""A real server on loopback, in a thread of the test process (uvicorn, real engine)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import uvicorn

from llmopt.runtime.llm import LLM
from llmopt.runtime.serve.app import ServeConfig, Server, build_app

MODEL = "toy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(artifact: Path, api_key: str | None = None, max_waiting: int = 64,
                **llm_kwargs: Any) -> Iterator[tuple[str, Server]]:
    """(base URL, Server) of a server that runs until the block ends."""
    server = Server(LLM(artifact, num_threads=1, **llm_kwargs),
                    ServeConfig(MODEL, api_key, max_waiting))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port,
                                       log_level="warning", access_log=False))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield base, server
    finally:
        uv.should_exit = True
        thread.join(10)


def metric(base: str, name: str, **labels: str) -> float:
    """One sample's value from GET /metrics (0 when absent)."""
    text = httpx.get(f"{base}/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in {"model_name": MODEL, **labels}.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(part in line for part in wanted.split(",")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
