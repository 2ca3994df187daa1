"""EngineLoop: one thread that owns the LLMEngine and steps it; the HTTP side talks to it
through a command queue and gets outputs back on its asyncio loop.

The engine is not thread-safe, so only this thread touches it. ONNX Runtime releases the
GIL while a step runs, so the event loop keeps serving HTTP meanwhile. Commands (add,
abort) are applied between steps, so requests join and leave between steps; an abort
frees the request's KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmopt.runtime.engine import LLMEngine
from llmopt.runtime.output import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.serve.metrics import ServerMetrics

logger = logging.getLogger("llmopt.serve")

Sink = Callable[[RequestOutput | BaseException], None]


@dataclass(eq=False)
class EngineRequest:
    """One engine request (one choice of an HTTP request) and where its outputs go."""

    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink  # called on the event loop with each output, or the error that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    engine_id: str | None = None  # set by the loop thread
    num_tokens_seen: int = 0
    last_token_time: float = 0.0
    finished: bool = False


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._commands: deque[tuple[str, EngineRequest]] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._requests: dict[str, EngineRequest] = {}  # by engine id; loop thread only
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)

    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._event_loop = event_loop
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left and end the thread."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    def add(self, request: EngineRequest) -> None:
        self._commands.append(("add", request))
        self._wakeup.set()

    def abort(self, request: EngineRequest) -> None:
        self._commands.append(("abort", request))
        self._wakeup.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(self.idle_wait_s)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
                logger.exception("engine step failed; aborting the running requests")
                self._fail_all(exc)
                continue
            self._dispatch(outputs)
        self._fail_all(RuntimeError("the server is shutting down"))

    def _apply_commands(self) -> None:
        while self._commands:
            kind, request = self._commands.popleft()
            if kind == "add":
                self._add(request)
            elif request.engine_id in self._requests:
                self.engine.abort_request(request.engine_id)
                del self._requests[request.engine_id]
                request.finished = True
                self.metrics.request_finished("abort")
        self._update_gauges()

    def _add(self, request: EngineRequest) -> None:
        if request.finished:  # aborted before it was added
            return
        try:
            request.engine_id = self.engine.add_request(request.prompt_token_ids, request.params)
        except ValueError as exc:
            request.finished = True
            self._send(request, exc)
            self.metrics.request_finished("error")
            return
        self._requests[request.engine_id] = request

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries = []
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            self.metrics.observe_tokens(request, output, now)
            if output.finished:
                del self._requests[output.request_id]
                request.finished = True
                self.metrics.request_done(output)
            deliveries.append((request.sink, output))
        if deliveries:
            self._call_soon(_deliver, deliveries)
        self._update_gauges()

    def _fail_all(self, exc: BaseException) -> None:
        for engine_id, request in list(self._requests.items()):
            self.engine.abort_request(engine_id)
            request.finished = True
            self._send(request, exc)
            self.metrics.request_finished("error")
        self._requests.clear()
        while self._commands:  # requests that never reached the engine
            kind, request = self._commands.popleft()
            if kind == "add" and not request.finished:
                request.finished = True
                self._send(request, exc)
        self._update_gauges()

    def _send(self, request: EngineRequest, item: RequestOutput | BaseException) -> None:
        self._call_soon(_deliver, [(request.sink, item)])

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        assert self._event_loop is not None
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._event_loop.call_soon_threadsafe(fn, *args)

    def _update_gauges(self) -> None:
        scheduler, kv = self.engine.scheduler, self.engine.kv_cache_manager
        usable = len(kv.block_pool.blocks) - 1
        self.metrics.set_state(len(scheduler.running), len(scheduler.waiting),
                               usable - kv.block_pool.num_free_blocks, usable)


def _deliver(deliveries: list[tuple[Sink, RequestOutput | BaseException]]) -> None:
    for sink, item in deliveries:
        sink(item)
