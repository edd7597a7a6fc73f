"""HTTP errors in OpenAI's JSON format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from marspec.errors import MarspecError, ModelOutputError

# OpenAI's `type` for each status the server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The JSON body of an error response (also sent as an SSE event when a stream fails midway)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """An error with an HTTP status, answered in OpenAI's format by the app's exception handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The error body for an exception raised while answering: its own for an :class:`ApiError`, a 400
    for a user error, a 500 saying so for the model's own failure, else a 500 that names no internals
    (the server log has the traceback)."""
    if isinstance(exc, ApiError):
        return exc.body()
    if isinstance(exc, ModelOutputError):
        return error_body(500, str(exc), code="model_output_invalid")
    if isinstance(exc, MarspecError):
        return error_body(400, str(exc))
    return error_body(500, "internal server error: the generation failed (see the server log)")


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: an error may quote what the client sent, and a lone UTF-16 surrogate
    in it has no UTF-8 form (Starlette's JSONResponse would fail to encode it: a 500 instead of the 4xx)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()
