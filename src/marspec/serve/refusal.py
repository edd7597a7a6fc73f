"""Answering a request from ASGI middleware, before the app sees it: an OpenAI error body, sent after
reading (within bounds) what the client is still sending.

Closing a connection whose receive buffer still holds unread bytes makes the kernel reset it, and a reset
can destroy the answer before the client has read it (seen in CI: headers arrived, the body did not). So
the rest of the body is read and thrown away first; past DRAIN_MAX_BYTES or DRAIN_SECONDS the client is
not a well-behaved one and the connection is closed anyway.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import Receive, Scope, Send

from marspec.serve.errors import error_body

DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_SECONDS = 10.0


async def drain_unless_waiting(scope: Scope, receive: Receive) -> None:
    """:func:`drain`, except for a client that waits for "100 Continue" before it sends its body: it has
    sent none, and reading would invite it."""
    if dict(scope["headers"]).get(b"expect", b"").lower() != b"100-continue":
        await drain(receive)


async def drain(receive: Receive) -> None:
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


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    *,
    close: bool = False,
    headers: dict[str, str] | None = None,
) -> None:
    """Send a complete error response; ``close`` asks the HTTP server to close the connection after it
    (``Connection: close``), for a request whose framing cannot be trusted or whose body was not read."""
    payload = json.dumps(error_body(status, message, code=code)).encode()  # ASCII: escapes what it quotes
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
