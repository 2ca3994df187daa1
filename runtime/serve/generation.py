"""Generation: the engine requests of one HTTP request (one per choice), on the event loop.

Outputs arrive from the engine thread through a queue; a client that disconnects, or a
handler that is cancelled, aborts every choice still running, so its KV blocks go back
to the pool between the engine's next two steps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request

from llmopt.runtime.output import RequestOutput
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.serve.engine_loop import EngineLoop, EngineRequest


class ClientDisconnected(Exception):
    """The HTTP client went away before its request finished."""


class Generation:
    def __init__(self, loop: EngineLoop, prompt_token_ids: list[int],
                 params: list[SamplingParams]):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.requests = [
            EngineRequest(prompt_token_ids, p, sink=lambda item, i=i: self.queue.put_nowait(
                (i, item)))
            for i, p in enumerate(params)
        ]
        self.done = [False] * len(params)
        self._watcher: asyncio.Task[None] | None = None

    def start(self, http_request: Request | None = None) -> None:
        for request in self.requests:
            self.loop.add(request)
        if http_request is not None:
            self._watcher = asyncio.create_task(self._watch(http_request))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they arrive, until every choice has finished."""
        while not all(self.done):
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.done[index] = True
                raise item
            if item.finished:
                self.done[index] = True
            yield index, item

    def close(self) -> None:
        """Abort the choices still running (a no-op once all finished)."""
        if self._watcher is not None:
            self._watcher.cancel()
        for index, request in enumerate(self.requests):
            if not self.done[index]:
                self.done[index] = True
                self.loop.abort(request)

    async def _watch(self, http_request: Request) -> None:
        """Wait for the client to disconnect; then stop the outputs and abort."""
        with contextlib.suppress(asyncio.CancelledError):
            while (await http_request.receive())["type"] != "http.disconnect":
                pass
            for index in range(len(self.requests)):
                if not self.done[index]:
                    self.queue.put_nowait((index, ClientDisconnected()))
