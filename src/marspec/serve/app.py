"""The FastAPI app: OpenAI-compatible routes (:mod:`marspec.serve.routes`) over one
:class:`~marspec.serve.engine.Engine`, behind the server's ASGI guards.

Every error is answered in OpenAI's format with a 4xx status when the request is at fault (malformed
JSON, missing or mistyped fields and FastAPI's own validation errors included: 400, never 422), 404 for
an unknown model, 429 when the queue is full, 503 while shutting down; 500 only for a server bug.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marspec import __version__
from marspec.api import Decoder
from marspec.batch.scheduler import batching_note
from marspec.errors import MarspecError, ModelOutputError, one_line
from marspec.serve.auth import ApiKeyAuth
from marspec.serve.body_limit import BodySizeLimit
from marspec.serve.engine import Engine
from marspec.serve.errors import ApiError, ErrorResponse, error_payload
from marspec.serve.framing import RefuseAmbiguousFraming
from marspec.serve.metrics import ServerMetrics
from marspec.serve.routes import router
from marspec.serve.served_model import ServedModel
from marspec.serve.settings import ServerSettings

log = logging.getLogger("marspec.serve")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def create_app(decoder: Decoder, settings: ServerSettings) -> FastAPI:
    """An app serving ``decoder`` under ``settings.model_name``. Its lifespan starts the engine's worker
    thread and, on shutdown, cancels what is left and joins it."""
    metrics = ServerMetrics()
    engine = Engine(
        decoder,
        max_queue=settings.max_queue,
        shutdown_grace=settings.shutdown_grace,
        metrics=metrics,
        max_batch=settings.max_batch,  # None: the pair's default, settled by the engine's scheduler
    )
    note = batching_note(decoder.target, engine.max_batch, "--max-batch")
    if note is not None:
        log.warning(note)
    served = ServedModel(decoder, settings, engine, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="marspec", version=__version__, lifespan=lifespan)
    app.state.served = served
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
    app.include_router(router)
    return app


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

    async def model_error(_: Request, exc: Exception) -> JSONResponse:
        return ErrorResponse(error_payload(exc), status_code=500)

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
        return ErrorResponse(error_payload(exc), status_code=500)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(MarspecError, user_error)
    app.add_exception_handler(ModelOutputError, model_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
