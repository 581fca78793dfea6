"""The FastAPI application: OpenAI-compatible routes over one `EngineLoop`.

    POST /v1/completions        prompt as text or token ids; "stream": true -> SSE chunks, then data: [DONE]
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the served model (a random-weight default says so)
    GET  /health                200 while the engine loop runs and admits requests, 503 otherwise
    GET  /metrics               Prometheus text (see metrics.py)

Handlers only validate, enqueue and stream: each request gets an asyncio queue that the loop thread feeds via
``call_soon_threadsafe``. A client that goes away (detected by waiting on ``http.disconnect``, and by the
streaming response being cancelled) gets its request aborted; the abort is applied before the next step.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import protocol
from .engine_loop import ABORTED, Channel, ChannelSink, EngineFailed, EngineLoop, ShuttingDown
from .metrics import CONTENT_TYPE, ServerMetrics


@dataclass
class ServedModel:
    names: tuple[str, ...]
    random_weights: bool
    description: str


def error_response(err: protocol.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise protocol.bad(None, f"request body: expected a JSON object, got malformed JSON ({exc})") from None


class _Stream:
    """One request's link to the loop thread: outputs arrive in an asyncio queue."""

    def __init__(self, loop: EngineLoop, channel: Channel):
        self.engine_loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sink = ChannelSink(channel, self.queue.put_nowait)
        self.finished = False

    async def next(self):
        item = await self.queue.get()
        if item is ABORTED:
            raise protocol.APIError(503, "the server shut down before the request finished", None,
                                    "service_unavailable")
        if isinstance(item, EngineFailed):
            raise protocol.APIError(500, str(item), None, "internal_error")
        self.finished = item.finished
        return item


class _Admission:
    """Requests into the engine loop: parse, admit (submit with a stream of their outputs), answer; errors in
    OpenAI's shape. One per app."""

    def __init__(self, loop: EngineLoop, metrics: ServerMetrics, limits: protocol.Limits):
        self.loop, self.metrics, self.limits = loop, metrics, limits
        self.channels: dict = {}

    def channel_of(self, event_loop) -> Channel:
        if event_loop not in self.channels:
            self.channels.clear()                  # one server runs one event loop; drop a stale one
            self.channels[event_loop] = Channel(event_loop)
        return self.channels[event_loop]

    async def admit(self, req: protocol.ParsedRequest, request: Request):
        loop = self.loop
        if not loop.admitting:
            raise protocol.APIError(503, "the server is shutting down; no new requests are admitted", None,
                                    "service_unavailable")
        stream = _Stream(loop, self.channel_of(asyncio.get_running_loop()))
        try:
            params = make_sampling_params(req.sampling)
            await asyncio.wrap_future(loop.submit(req.prompt_token_ids, params, req.request_id, stream.sink,
                                                  final_only=not req.stream))
        except ShuttingDown as exc:
            raise protocol.APIError(503, str(exc), None, "service_unavailable") from None
        except ValueError as exc:                  # RequestRejected (a ValueError with .param): nothing was added
            raise protocol.bad(api_param(getattr(exc, "param", None), req), str(exc)) from None
        return stream

    async def handle(self, request: Request, parse):
        try:
            req = parse(await read_json(request), self.loop.engine.tokenizer, self.limits)
            stream = await self.admit(req, request)
        except protocol.APIError as err:
            self.metrics.rejected.inc()
            return error_response(err)
        except ClientDisconnect:                   # gone before its body arrived: nothing was admitted
            return Response(status_code=499)
        if req.stream:
            return StreamingResponse(sse_events(req, stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole_response(req, stream, request)


def build_app(loop: EngineLoop, served: ServedModel, metrics: ServerMetrics) -> FastAPI:
    engine = loop.engine
    limits = protocol.Limits(served.names, int(engine.max_model_len), vocab_size_of(engine))
    app = FastAPI(title="kvengine", docs_url=None, redoc_url=None, openapi_url=None)
    admission = _Admission(loop, metrics, limits)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await admission.handle(request, protocol.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await admission.handle(request, protocol.parse_chat)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """Unknown routes and methods answer in OpenAI's error shape too."""
        return error_response(protocol.APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                f"{exc.detail}", None, "invalid_request_error"))

    add_model_routes(app, served, limits)
    add_status_routes(app, loop, metrics)
    return app


def add_model_routes(app: FastAPI, served: ServedModel, limits: protocol.Limits) -> None:
    """GET /v1/models and /v1/models/{name}."""
    created = int(time.time())

    def card(name: str) -> dict:
        return protocol.model_card(name, created, served.random_weights, limits.max_model_len, served.description)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in served.names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        try:
            return card(protocol.check_model({"model": name}, limits))
        except protocol.APIError as err:
            return error_response(err)


def add_status_routes(app: FastAPI, loop: EngineLoop, metrics: ServerMetrics) -> None:
    """GET /health and /metrics."""
    @app.get("/health")
    async def health():
        if loop.error is not None:
            return JSONResponse({"status": "failed", "error": repr(loop.error)}, status_code=503)
        if not loop.admitting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)


async def whole_response(req: protocol.ParsedRequest, stream: _Stream, request: Request):
    """Wait for the last output; abort the request if the client disconnects first."""
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        while True:
            getter = asyncio.ensure_future(stream.next())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:                 # the client went away
                getter.cancel()
                stream.engine_loop.abort(req.request_id)
                return Response(status_code=499)
            out = getter.result()
            if out.finished:
                return protocol.final_response(req, out)
    except protocol.APIError as err:
        return error_response(err)
    finally:
        watcher.cancel()
        if not stream.finished:
            stream.engine_loop.abort(req.request_id)


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def sse_events(req: protocol.ParsedRequest, stream: _Stream):
    """The SSE body; cancelled by Starlette when the client disconnects (then the request is aborted)."""
    first = True
    try:
        while True:
            try:
                out = await stream.next()
            except protocol.APIError as err:
                yield sse(err.body())
                break
            if out.new_token_ids or out.text_delta or out.finished or (first and req.kind == "chat"):
                yield sse(protocol.stream_chunk(req, out, first))
                first = False
            if out.finished:
                if req.include_usage:
                    yield sse(protocol.usage_chunk(req, out))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:
            stream.engine_loop.abort(req.request_id)


def api_param(param, req: protocol.ParsedRequest):
    """The request field an engine refusal is about (the engine names ``prompt_token_ids``)."""
    if param == "prompt_token_ids":
        return "prompt" if req.kind == "completion" else "messages"
    return param


def make_sampling_params(kwargs: dict):
    from decode.serve import SamplingParams

    return SamplingParams(**kwargs)


def vocab_size_of(engine) -> int | None:
    """The model's vocabulary (token ids must be below it), when the engine exposes its model config."""
    for owner in (engine, getattr(engine, "model", None), getattr(getattr(engine, "model", None), "config", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None
