"""Refusing request bodies larger than the server's limit before anything parses them.

Without a limit a client can make the server read, parse and tokenize a body of any size while every
queued request waits. FastAPI reads the whole body before it calls a route anyway, so buffering it here
up to the limit costs no extra copy of an accepted body and bounds the memory of a refused one.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marspec.serve.refusal import drain, drain_unless_waiting, send_error


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
            await drain_unless_waiting(scope, receive)
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
                    await drain(receive)
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
        message = (
            f"the request body is {size} but this server accepts at most {self.max_bytes:,} bytes "
            f"({limit_mb:g} MB, marspec serve --max-request-mb): send a shorter prompt"
        )
        # The rest of the body is never read, so the connection cannot be reused.
        await send_error(send, 413, message, "request_too_large", close=True)
