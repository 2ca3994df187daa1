"""The OpenAI-compatible HTTP app: routes, auth, errors, and the request/response flow.

Handlers are asynchronous and never touch the engine: they tokenize, validate, hand the
engine requests to the EngineLoop and relay its outputs, whole or as server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmopt.runtime.llm import LLM
from llmopt.runtime.output import RequestOutput
from llmopt.runtime.scheduler import check_prompt_length
from llmopt.runtime.serve.engine_loop import EngineLoop
from llmopt.runtime.serve.generation import ClientDisconnected, Generation
from llmopt.runtime.serve.metrics import ServerMetrics
from llmopt.runtime.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from llmopt.runtime.serve.responses import ResponseBuilder, error_body, sse, usage
from llmopt.runtime.serve.tools.choices import ChoiceReplies
from llmopt.runtime.serve.tools.request import ToolError, ToolPlan, plan_tools
from llmopt.runtime.structured.compiler import GrammarError
from llmopt.runtime.structured.manager import StructuredOutputManager
from llmopt.runtime.structured.params import StructuredOutputsParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # requests queued beyond the running batch before 503s


class Server:
    """What the routes share: the LLM, its engine loop, metrics and admission state."""

    def __init__(self, llm: LLM, config: ServeConfig):
        self.llm = llm
        self.config = config
        self.metrics = ServerMetrics(config.served_model_name)
        self.loop = EngineLoop(llm.engine, self.metrics)
        self.capacity = llm.engine.config.max_num_seqs + config.max_waiting
        self.in_flight = 0  # engine requests admitted and not yet finished
        self.draining = False  # set on SIGTERM: admit nothing new
        self.structured = _structured_outputs(llm)
        reserve_kv_pool(llm)

    async def check_constraint(self, params: StructuredOutputsParams, field: str) -> None:
        """A 400 naming the problem when the grammar engine cannot compile `params`."""
        if isinstance(self.structured, str):
            raise APIError(400, f"{field}: {self.structured}", param=field)
        try:  # compiling a large schema takes a while: off the event loop
            await asyncio.to_thread(self.structured.compiler.check, params)
        except GrammarError as exc:
            raise APIError(400, f"{field}: {exc}", param=field) from exc

    def admit(self, num_requests: int) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable",
                           headers={"Retry-After": "5"})
        if self.in_flight + num_requests > self.capacity:
            self.metrics.request_finished("rejected")
            raise APIError(503, f"the waiting queue is full ({self.capacity} requests in "
                           "flight); retry later", "service_unavailable",
                           headers={"Retry-After": "1"})

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {key}":
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                           "KEY')", "authentication_error")

    def check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.config.served_model_name}'", "not_found_error", "model")


def _structured_outputs(llm: LLM) -> StructuredOutputManager | str:
    """The engine's grammars, built now rather than in the first request; without
    llguidance, why not."""
    try:
        return llm.engine.structured
    except GrammarError as exc:
        return str(exc)


def reserve_kv_pool(llm: LLM) -> None:
    """Write every KV pool page once, so the server's memory is its steady state from the
    start: a pool the machine cannot hold fails now, not mid-load, and RSS stays flat
    instead of growing as the free queue cycles through blocks never touched before."""
    for pools in llm.engine.kv_cache_manager.pools:  # every graph's
        for pool in pools.values():
            pool.fill(0)


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        server.loop.start(asyncio.get_running_loop())
        yield
        server.loop.stop()

    app = FastAPI(title="llmopt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.kind, exc.status, exc.param),
                            status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", 400, param),
                            status_code=400)


def _add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health() -> Response:
        ok = server.loop.alive and not server.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.check_auth(request)
        name = server.config.served_model_name
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "llmopt",
            "max_model_len": server.llm.engine.config.max_context}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_auth(request)
        server.check_model(body.model)
        tools = await _tool_plan(server, body)
        try:
            messages = [m.template_dict() for m in body.messages]
            prompt_ids = server.llm.tokenizer.encode_chat(
                messages, tools=tools.template_tools if tools else None)
        except Exception as exc:  # noqa: BLE001 - a template error is the client's input
            raise APIError(400, f"messages: {exc}", param="messages") from exc
        return await _generate(server, body, request, prompt_ids, chat=True, tools=tools)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_auth(request)
        server.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt_ids = server.llm.tokenizer.encode(prompt)
        else:
            vocab_size = server.llm.manifest.model.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab_size})", param="prompt")
            prompt_ids = list(prompt)
        return await _generate(server, body, request, prompt_ids, chat=False)


async def _tool_plan(server: Server, body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools, each one's parameter schema checked by the grammar engine."""
    try:
        plan = plan_tools(body, server.llm.tokenizer.spec.chat_template)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    for function in plan.functions if plan is not None else ():
        if function.get("parameters") is not None:
            await server.check_constraint(StructuredOutputsParams(json=function["parameters"]),
                                          f"tools[{function['name']}].parameters")
    return plan


async def _constraint(server: Server, body: ChatCompletionRequest | CompletionRequest,
                      tools: ToolPlan | None) -> StructuredOutputsParams | None:
    """What the output must match: a forced tool call, or the response format asked."""
    try:
        params, field = body.constraint()
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    forced = tools.constraint(server.llm.tokenizer) if tools is not None else None
    if forced is not None:
        if params is not None:
            raise APIError(400, f"tool_choice '{tools.choice}' forces a tool call; it cannot "
                           f"be combined with {field}", param="tool_choice")
        params, field = forced, "tool_choice"
    if params is not None:
        await server.check_constraint(params, field)
    return params


async def _generate(server: Server, body: ChatCompletionRequest | CompletionRequest,
                    request: Request, prompt_ids: list[int], chat: bool,
                    tools: ToolPlan | None = None) -> Response:
    max_context = server.llm.engine.config.max_request_tokens
    try:
        check_prompt_length(len(prompt_ids), max_context, False)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages" if chat else "prompt") from exc
    constraint = await _constraint(server, body, tools)
    if constraint is not None and body.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with a constrained output",
                       param="ignore_eos")
    room = max_context - len(prompt_ids)
    wanted = body.requested_max_tokens or (room if chat else DEFAULT_COMPLETION_MAX_TOKENS)
    defaults = server.llm.default_params
    params = [body.sampling_params(defaults, min(wanted, room), i, body.num_logprobs,
                                   constraint)
              for i in range(body.n)]
    server.admit(body.n)
    generation = Generation(server.loop, prompt_ids, params)
    server.in_flight += body.n
    generation.start(request)
    builder = ResponseBuilder(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                              body.model, server.llm.tokenizer)
    replies = ChoiceReplies(server.llm.tokenizer, server.llm.engine.eos_token_ids, tools,
                            body.n)
    if body.stream:
        return StreamingResponse(
            _stream(server, generation, builder, body, len(prompt_ids), replies),
            media_type="text/event-stream")
    try:
        finals = await _collect(generation)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the choices were aborted
    finally:
        _release(server, generation)
    choices = [replies.choice(builder, i, o) for i, o in enumerate(finals)]
    return JSONResponse(builder.response(
        choices, usage(len(prompt_ids), sum(len(o.token_ids) for o in finals))))


def _release(server: Server, generation: Generation) -> None:
    generation.close()
    server.in_flight -= len(generation.requests)


async def _collect(generation: Generation) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in generation.outputs():
            if output.finished:
                finals[index] = output
    except ClientDisconnected:
        raise
    except Exception as exc:  # noqa: BLE001 - the engine refused or failed this request
        raise APIError(500, f"generation failed: {exc}", "server_error") from exc
    return [finals[i] for i in range(len(generation.requests))]


async def _stream(server: Server, generation: Generation, builder: ResponseBuilder,
                  body: SamplingRequest, num_prompt_tokens: int,
                  replies: ChoiceReplies) -> AsyncIterator[str]:
    """Server-sent events: deltas per choice, a final chunk with finish_reason, optional
    usage, then `data: [DONE]`."""
    sent_text = [0] * body.n
    sent_logprobs = [0] * body.n
    num_generated = [0] * body.n
    try:
        if builder.chat:
            for i in range(body.n):
                yield sse(builder.chunk(i, "", None, None, first=True))
        async for i, output in generation.outputs():
            delta, calls, finish_reason = replies.delta(i, output, sent_text[i])
            new_logprobs = (output.logprobs[sent_logprobs[i]:]
                            if output.logprobs is not None else None)
            if delta or calls or output.finished or new_logprobs:
                yield sse(builder.chunk(i, delta, finish_reason, new_logprobs,
                                        text_offset=sent_text[i], tool_calls=calls))
            sent_text[i] += len(delta)
            sent_logprobs[i] += len(new_logprobs or ())
            num_generated[i] = len(output.token_ids)
        if body.include_usage:
            yield sse(builder.usage_chunk(usage(num_prompt_tokens, sum(num_generated))))
        yield sse("[DONE]")
    except ClientDisconnected:
        return
    except Exception as exc:  # noqa: BLE001 - report in-band: the headers are already sent
        yield sse(error_body(f"generation failed: {exc}", "server_error", 500))
    finally:
        _release(server, generation)
