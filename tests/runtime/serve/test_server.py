"""`llmopt serve` as users run it: a process, SIGTERM, and what it imports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from live_server import MODEL, free_port
from toy_artifact import build_artifact

IMPORT_CHECK = """
import sys
from llmopt.runtime.llm import LLM
from llmopt.runtime.serve.app import ServeConfig, Server, build_app
import llmopt.runtime.serve.server
build_app(Server(LLM(sys.argv[1]), ServeConfig("toy")))
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "onnx")))
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return build_artifact(tmp_path_factory.mktemp("toy"))


def test_the_server_imports_neither_torch_nor_transformers(artifact):
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(artifact)],
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def start(artifact: Path, port: int, *extra: str) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("llmopt")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "llmopt.cli"]
    process = subprocess.Popen(
        [*command, "serve", str(artifact), "--port", str(port), "--served-model-name", MODEL,
         "--threads", "1", "--grace-period", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"llmopt serve did not start: {process.communicate()[0]}")


def test_sigterm_finishes_in_flight_requests_and_exits_0(artifact):
    port = free_port()
    process = start(artifact, port)
    try:
        maps = Path(f"/proc/{process.pid}/maps")
        if maps.exists():  # the serving process has loaded no torch library
            assert "libtorch" not in maps.read_text()
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 50, "stream": True,
                "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(process.pid, signal.SIGTERM)
            rest = list(lines)
        assert "data: [DONE]" in rest and any('"length"' in line for line in rest)
        assert process.wait(30) == 0
        with pytest.raises(httpx.TransportError):  # no longer admitting
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_errors_are_one_line(tmp_path):
    cli = Path(sys.executable).with_name("llmopt")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "llmopt.cli"]
    result = subprocess.run([*command, "serve", str(tmp_path / "missing")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    unloadable = tmp_path / "unloadable"  # loading it first would fail with another error
    unloadable.mkdir()
    (unloadable / "manifest.json").write_text("{}")
    cli = Path(sys.executable).with_name("llmopt")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "llmopt.cli"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*command, "serve", str(unloadable), "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: cannot listen on 127.0.0.1:{port}: Address already in "
                             "use (choose another --port or --host)\n")


def test_startup_line_names_model_kernels_threads_and_address(artifact):
    port = free_port()
    process = start(artifact, port)
    try:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert (f"llmopt serve: model '{MODEL}' ({artifact}) on http://127.0.0.1:{port}/v1; "
            "kernels: onnxruntime; threads: 1") in output
