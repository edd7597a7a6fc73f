"""Refusing a request whose body length is stated two ways: Content-Length and Transfer-Encoding.

RFC 9112 section 6.3: such a message "might indicate an attempt to perform request smuggling" (a proxy
in front may have read the body by one header and this server by the other, so the two disagree where
the next request begins), and "the server MUST close the connection after responding". uvicorn's h11
reads the body by Transfer-Encoding, answers, and keeps the connection open, serving whatever follows;
this middleware answers 400 (code ``ambiguous_framing``) and closes the connection instead.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from marspec.serve.refusal import drain_unless_waiting, send_error


class RefuseAmbiguousFraming:
    """ASGI middleware: 400 and ``Connection: close`` for a request carrying both headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                # The body as the HTTP layer framed it (by Transfer-Encoding), read so the answer arrives.
                await drain_unless_waiting(scope, receive)
                message = (
                    "the request has both Content-Length and Transfer-Encoding, which RFC 9112 treats as "
                    "a possible request-smuggling attempt: send one of them; the connection is closed"
                )
                await send_error(send, 400, message, "ambiguous_framing", close=True)
                return
        await self.app(scope, receive, send)
