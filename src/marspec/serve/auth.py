"""Requiring an API key (``marspec serve --api-key`` or ``MARSPEC_API_KEY``): every request but
``GET /health`` must carry ``Authorization: Bearer KEY``, as OpenAI's clients send their ``api_key``.

``/health`` stays open because load balancers and orchestrators probe it without credentials, and it
tells nothing but whether the server takes requests. ``/metrics`` needs the key like the API: its counters
describe the traffic (Prometheus sends a key with ``authorization: {credentials_file: ...}``).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from marspec.serve.refusal import drain_unless_waiting, send_error

OPEN_PATHS = frozenset({"/health"})


class ApiKeyAuth:
    """ASGI middleware answering 401 in OpenAI's format (code ``missing_api_key`` or ``invalid_api_key``)
    to a request without the right bearer key, before its body is parsed."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = bearer_token(scope["headers"])
        # Both sides hashed to one length first, so that the comparison's time says nothing about the
        # key, not even its length; compare_digest then takes the same time wherever they differ.
        if given is not None and hmac.compare_digest(_digest(given), self._digest):
            await self.app(scope, receive, send)
            return
        if given is None:
            message, code = (
                "this server requires an API key: send the header Authorization: Bearer KEY (the OpenAI "
                "client's api_key) with the key marspec serve was started with",
                "missing_api_key",
            )
        else:
            message, code = "the API key is not this server's: check the key you send", "invalid_api_key"
        await drain_unless_waiting(scope, receive)
        await send_error(send, 401, message, code, headers={"WWW-Authenticate": "Bearer"})


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key of the request's one ``Authorization: Bearer KEY`` header (the scheme's case does not
    matter, RFC 9110 section 11.1), or None without one (or with several, which are ambiguous)."""
    values = [value for name, value in headers if name == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
