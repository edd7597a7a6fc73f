"""The FastAPI app: OpenAI-compatible routes over one :class:`~marspec.serve.engine.Engine`.

Every error is answered in OpenAI's format with a 4xx status when the request is at fault (malformed
JSON, missing or mistyped fields and FastAPI's own validation errors included: 400, never 422), 404 for
an unknown model, 429 when the queue is full, 503 while shutting down; 500 only for a server bug.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marspec import __version__
from marspec.api import Decoder, GenerationOptions
from marspec.errors import MarspecError, one_line
from marspec.prompting import Prompt, fewest_tokens, longest_token_bytes, render_prompt
from marspec.rules import LOSSLESS_RULES
from marspec.serve.auth import ApiKeyAuth
from marspec.serve.body_limit import BodySizeLimit
from marspec.serve.engine import Delta, Engine, Event, Failed, Finished, Job, context_length_error
from marspec.serve.errors import ApiError, ErrorResponse, error_body
from marspec.serve.framing import RefuseAmbiguousFraming
from marspec.serve.metrics import CONTENT_TYPE, ServerMetrics
from marspec.serve.responses import Responder, sse
from marspec.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from marspec.serve.settings import ServerSettings

# How often a request waiting for the model checks whether its client is still there.
DISCONNECT_POLL_S = 0.2
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(decoder: Decoder, settings: ServerSettings) -> FastAPI:
    """An app serving ``decoder`` under ``settings.model_name``. Its lifespan starts the engine's worker
    thread and, on shutdown, cancels what is left and joins it."""
    metrics = ServerMetrics()
    engine = Engine(
        decoder, max_queue=settings.max_queue, shutdown_grace=settings.shutdown_grace, metrics=metrics
    )
    context_length = decoder.target.context_length
    bytes_per_token = longest_token_bytes(decoder.tokenizer)
    has_drafter = decoder.drafter is not None
    started = int(time.time())
    defaults_card = _defaults_card(decoder, settings.defaults)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="marspec", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    # Starlette runs the middleware added last first: metrics count every answer; a request with two
    # body lengths is refused before anything else, one without the key before its body is read.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key)
    app.add_middleware(RefuseAmbiguousFraming)
    app.add_middleware(RequestMetrics, metrics=metrics)
    _install_error_handlers(app)

    async def wait_for_event(request: Request, job: Job, first: bool) -> Event:
        """The job's first event (``first``) or its final one. Meanwhile, every DISCONNECT_POLL_S (also
        while deltas keep arriving), check the client is still there; if not, cancel the job, answer 499."""
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                if first or not isinstance(event, Delta):
                    return event
            except TimeoutError:
                pass
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    engine.cancel(job, "disconnect")
                    raise ApiError(499, "the client closed the request", code="client_closed_request")

    def refuse_if_surely_too_long(prompt: Prompt, chat: bool | None) -> None:
        """Refuse a prompt whose byte count alone proves it cannot fit the context, here on the event
        loop, so that it never occupies the worker with tokenizing it (the worker counts exactly)."""
        if not context_length:
            return
        chat = decoder.chat_default if chat is None else chat
        try:
            text, _ = render_prompt(decoder.tokenizer, prompt, chat, decoder.target.name)
        except MarspecError:
            return  # the worker reports it, naming the parameter
        fewest = fewest_tokens(text, bytes_per_token)
        if fewest >= context_length:
            param = "prompt" if isinstance(prompt, str) else "messages"
            raise context_length_error(context_length, f"at least {fewest:,}", param)

    async def stream_events(job: Job, event: Event, out: Responder) -> AsyncIterator[bytes]:
        ended = False
        try:
            for chunk in out.opening_chunks():
                yield sse(chunk)
            while True:
                if isinstance(event, Delta):
                    yield sse(out.text_chunk(event.text))
                elif isinstance(event, Finished):
                    ended = True
                    for chunk in out.closing_chunks(event.outcome):
                        yield sse(chunk)
                    break
                else:  # failed after the response started (shutdown, or a bug): an OpenAI error event
                    ended = True
                    yield sse(_error_payload(event.error))
                    break
                event = await job.events.get()
            yield sse("[DONE]")
        finally:
            if not ended:  # the client went away (Starlette cancelled or closed this generator)
                engine.cancel(job, "disconnect")

    async def complete(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        gen = parse_request(body, settings, context_length=context_length, has_drafter=has_drafter)
        refuse_if_surely_too_long(gen.prompt, gen.options.chat)
        try:  # theta="auto": the pair's calibrated setting, echoed in the response as resolved
            gen = replace(gen, options=decoder.resolve_theta(gen.options))
        except MarspecError as exc:
            raise ApiError(400, str(exc), param="marspec.theta") from None
        job = Job(gen.prompt, gen.options, timeout=gen.timeout)
        engine.submit(job)
        out = Responder(
            isinstance(body, ChatCompletionRequest), settings.model_name, gen.options, gen.include_usage
        )
        try:
            # Streams too wait for the first event before answering, so that an error found by the
            # worker (a prompt longer than the context, a queue timeout) still gets its status code.
            event = await wait_for_event(request, job, first=gen.stream)
            if gen.stream and not isinstance(event, Failed):
                return StreamingResponse(
                    stream_events(job, event, out),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                    # Runs after Starlette saw the client disconnect, too: a second, certain cancel hook.
                    background=BackgroundTask(engine.cancel, job, "disconnect"),
                )
        except BaseException:  # cancelled by the server (shutdown timeout) or the client left
            engine.cancel(job, "disconnect")
            raise
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, Finished)
        return JSONResponse(out.response(event.outcome))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions; extra body field ``marspec``: {rule, theta, margin, k}."""
        return await complete(request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI (legacy) text completions: the prompt is continued as raw text, no chat template."""
        return await complete(request, body)

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": started,
            "owned_by": "marspec",
            "context_length": context_length,
            "marspec": defaults_card,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if model != settings.model_name:
            raise ApiError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while requests are accepted; 503 while draining for shutdown or if the worker died."""
        status = "ok" if engine.alive and not engine.draining else "draining" if engine.draining else "down"
        body = {"status": status, "model": settings.model_name, "queue_depth": engine.queue_depth}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _defaults_card(decoder: Decoder, defaults: GenerationOptions) -> dict[str, Any]:
    """What a request that sets no ``marspec`` field gets: the rule, whether it is lossless, k, and for a
    lossy rule the margin and theta it decodes with when greedy and when sampling (they may differ, by
    measurement or by calibration)."""
    lossless = defaults.rule in LOSSLESS_RULES
    card: dict[str, Any] = {"rule": defaults.rule, "lossless": lossless, "k": defaults.k}
    if lossless:
        return card  # a margin or theta would mean nothing to it
    for regime, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        try:
            resolved = decoder.resolve_theta(replace(defaults, temperature=temperature))
        except MarspecError as exc:  # theta="auto" with no calibration for this regime
            card[regime] = {"error": str(exc)}
            continue
        card[regime] = {"margin": resolved.margin, "theta": resolved.theta}
    return card


class RequestMetrics:
    """ASGI middleware counting responses by endpoint and status and timing them to their last byte
    (for a stream, the end of the stream)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"  # bounded label values
        start = time.monotonic()
        status = 500  # if the app raises before answering, the server error handler answers 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            self.metrics.request_latency.labels(endpoint=endpoint).observe(time.monotonic() - start)


def _error_payload(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, ApiError):
        return exc.body()
    if isinstance(exc, MarspecError):
        return error_body(400, str(exc))
    return error_body(500, "internal server error: the generation failed (see the server log)")


def _validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """One clear 400 for FastAPI's validation errors (the first one is reported)."""
    first = errors[0]
    loc = [p for p in first["loc"] if p != "body"]
    # A union (e.g. content: str | list) reports one error per member, each with the member as the last
    # location part; the parameter is the location before it.
    if sum(1 for e in errors if list(e["loc"][:-1]) == list(first["loc"][:-1])) > 1:
        loc = loc[:-1]
    param = ".".join(str(p) for p in loc) or None
    kind = first["type"]
    if kind == "json_invalid":
        return ApiError(
            400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", code="invalid_json"
        )
    if kind == "string_unicode":  # pydantic's refusal of a lone surrogate where it checks a string
        where = f"{param!r} holds" if param else "a field name holds"
        return ApiError(
            400,
            f"{where} a lone UTF-16 surrogate, which is not Unicode text: send valid UTF-8",
            param=param,
            code="invalid_unicode",
        )
    if param is None:
        return ApiError(
            400,
            "the request body must be a JSON object, sent with Content-Type: application/json",
            code="invalid_body",
        )
    if kind == "extra_forbidden":
        return ApiError(
            400,
            f"unsupported parameter {param!r}: marspec serve does not implement it; leave it out",
            param=param,
            code="unsupported_parameter",
        )
    if kind == "missing":
        return ApiError(400, f"missing required parameter {param!r}", param=param, code="missing_parameter")
    return ApiError(400, f"invalid {param!r}: {first['msg']}", param=param, code="invalid_type")


def _unreadable_json(exc: StarletteHTTPException) -> ApiError | None:
    """The server's ``invalid_json`` error for a body FastAPI could not parse for a reason other than a
    JSON syntax error (those arrive as validation errors): bytes that are not UTF-8, or nesting deeper
    than Python's parser recurses. FastAPI answers them with a generic 400 caused by the parser's error."""
    cause = exc.__cause__
    if exc.status_code != 400 or not isinstance(cause, (ValueError, RecursionError)):
        return None
    if isinstance(cause, UnicodeDecodeError):
        why = f"it is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start})"
    elif isinstance(cause, RecursionError):
        why = "its arrays and objects are nested too deeply to parse"
    else:
        why = one_line(cause)
    return ApiError(400, f"the body is not valid JSON: {why}", code="invalid_json")


def _install_error_handlers(app: FastAPI) -> None:
    def answer(exc: ApiError) -> JSONResponse:
        return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return answer(exc)

    async def user_error(_: Request, exc: Exception) -> JSONResponse:
        return answer(ApiError(400, str(exc)))

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return answer(_validation_error(list(exc.errors())))

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        unreadable = _unreadable_json(exc)
        if unreadable is not None:
            return answer(unreadable)
        return answer(ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, so uvicorn logs its traceback.
        return ErrorResponse(_error_payload(exc), status_code=500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(MarspecError, user_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
