"""Run the app under uvicorn: one process, one event loop, one engine thread.

SIGTERM (or Ctrl-C) stops admitting (new requests get 503, the listener closes), lets
in-flight requests finish within the grace period, then stops the engine; exit code 0.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from llmopt.runtime.llm import LLM
from llmopt.runtime.serve.app import ServeConfig, Server, build_app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, telling our Server to admit nothing once a signal arrives."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.llmopt_server = server

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.llmopt_server.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown (the process would die of
        # SIGTERM); a drained, clean stop exits 0 instead.
        self._captured_signals.clear()


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT (OSError when taken), so the port is ours before loading."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    # uvicorn binds the same way: a restarted server may take a port in TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(artifact: str | Path, config: ServeConfig, listener: socket.socket, *,
          grace_period_s: float = 30.0, log_level: str = "info", **llm_kwargs: Any) -> None:
    """Load ARTIFACT and serve it on LISTENER until a signal; returns when shut down cleanly."""
    llm = LLM(artifact, **llm_kwargs)
    server = Server(llm, config)
    host, port = listener.getsockname()[:2]
    uv_config = uvicorn.Config(
        build_app(server), host=host, port=port, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=grace_period_s, timeout_keep_alive=30,
    )
    address = f"[{host}]" if ":" in host else host
    print(f"llmopt serve: model '{config.served_model_name}' ({artifact}) on "
          f"http://{address}:{port}/v1; {llm.execution_summary()}", file=sys.stderr, flush=True)
    _DrainingServer(uv_config, server).run(sockets=[listener])
