"""Run the app under uvicorn: one process, one event loop, one engine thread.

SIGTERM (or Ctrl-C) stops admitting (new requests get 503, the listener closes), lets
in-flight requests finish within the grace period, then stops the engine; exit code 0.
"""

from __future__ import annotations

import logging
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


def serve(artifact: str | Path, config: ServeConfig, *, host: str = "127.0.0.1",
          port: int = 8000, grace_period_s: float = 30.0, log_level: str = "info",
          **llm_kwargs: Any) -> None:
    """Load ARTIFACT and serve it until a signal; returns when shut down cleanly."""
    llm = LLM(artifact, **llm_kwargs)
    server = Server(llm, config)
    uv_config = uvicorn.Config(
        build_app(server), host=host, port=port, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=grace_period_s, timeout_keep_alive=30,
    )
    logging.getLogger("llmopt.serve").info(
        "serving %s as '%s' on http://%s:%d", artifact, config.served_model_name, host, port)
    _DrainingServer(uv_config, server).run()
