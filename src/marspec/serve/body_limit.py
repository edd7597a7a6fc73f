"""Refusing request bodies larger than the server's limit before anything parses them.

Without a limit a client can make the server read, parse and tokenize a body of any size while every
queued request waits. FastAPI reads the whole body before it calls a route anyway, so buffering it here
up to the limit costs no extra copy of an accepted body and bounds the memory of a refused one.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marspec.serve.errors import error_body

# How much of a refused body is read and thrown away before answering. Closing a connection whose
# receive buffer still holds unread bytes makes the kernel reset it, and a reset can destroy the 413
# before the client has read it (seen in CI: headers arrived, the body did not). Past these bounds the
# client is not a well-behaved one and the connection is closed anyway.
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_SECONDS = 10.0


class BodySizeLimit:
    """ASGI middleware answering 413 (OpenAI's error format, code ``request_too_large``) to a request
    whose body exceeds ``max_bytes``: at once when its Content-Length says so, otherwise as soon as the
    bytes received pass the limit (a chunked upload)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # A client that waits for "100 Continue" has sent no body yet: answer at once (reading
            # would invite the body). Any other client is already sending it.
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await _drain(receive)
            await self._refuse(send, int(declared))
            return
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                await self._refuse(send, None)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            # The buffered body first, then whatever the connection says next (a disconnect).
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        size = f"{declared:,} bytes" if declared is not None else "more than that"
        limit_mb = self.max_bytes / 2**20
        body = error_body(
            413,
            f"the request body is {size} but this server accepts at most {self.max_bytes:,} bytes "
            f"({limit_mb:g} MB, marspec serve --max-request-mb): send a shorter prompt",
            code="request_too_large",
        )
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        # The rest of the body is never read, so the connection cannot be reused.
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def _drain(receive: Receive) -> None:
    """Read and discard the rest of a request body, within DRAIN_MAX_BYTES and DRAIN_SECONDS."""
    discarded = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            while discarded < DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                discarded += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return
