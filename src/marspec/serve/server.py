"""Running the app under uvicorn: the listening socket, and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from marspec.api import Decoder
from marspec.errors import MarspecError
from marspec.serve.app import create_app
from marspec.serve.engine import Engine
from marspec.serve.settings import ServerSettings

# uvicorn waits this much longer than the engine's grace for connections to close before cancelling
# them: by then the engine has ended every job, so this only catches a client that stopped reading.
UVICORN_EXTRA_GRACE_S = 10.0
# Seconds a client may take to send a request's line and headers, counted from the connection's start or
# from its first byte after an answer. uvicorn has no such limit (its keep-alive timer stops at the first
# byte), so a client sending headers a byte at a time, or half of them, would hold a connection forever.
HEADER_TIMEOUT_S = 15.0


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now (port 0 picks a free one), so that a taken port is reported before the
    models spend seconds loading. uvicorn starts listening on it once the app is up."""
    if not 0 <= port <= 65535:
        raise MarspecError(f"--port must be in [0, 65535], got {port}")
    try:
        families = [info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        # "localhost" may resolve to ::1 first; IPv4 is what most clients try first.
        family = socket.AF_INET if socket.AF_INET in families else families[0]
        # IPPROTO_TCP named, so that asyncio sees the accepted sockets as TCP and sets TCP_NODELAY on
        # them: without it (protocol 0) Nagle's algorithm held each response after a connection's first
        # for a delayed ACK (~40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # and inherited where the OS does
        sock.bind((host, port))
    except OSError as exc:
        raise MarspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11), closing a connection whose request line and headers have not
    all arrived within ``header_timeout`` seconds of the connection's start, or of the first byte after
    an answer."""

    header_timeout = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Time the head while the client has begun (or not yet begun) a request whose headers have not
        all arrived; stop timing once they have. Between requests uvicorn's keep-alive timer rules."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if not waiting:
            self._stop_head_timer()
        elif self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: FastAPI, settings: ServerSettings, log_level: str = "info") -> uvicorn.Config:
    """How uvicorn serves ``app``: HTTP/1.1 by h11 with a limit on the time headers take
    (:class:`HeaderTimeoutProtocol`), and a shutdown grace beyond the engine's."""
    return uvicorn.Config(
        app,
        http=HeaderTimeoutProtocol,
        log_level=log_level,
        timeout_graceful_shutdown=settings.shutdown_grace + UVICORN_EXTRA_GRACE_S,
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM/SIGINT stops accepting connections and waits for open ones;
    this one also tells the engine to refuse new jobs and to cancel unfinished ones after the grace."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.engine.begin_shutdown()
        super().handle_exit(sig, frame)


def run_server(
    decoder: Decoder, settings: ServerSettings, sock: socket.socket, log_level: str = "info"
) -> None:
    """Serve until SIGTERM or SIGINT, then drain: queued and running generations may finish within
    ``settings.shutdown_grace`` seconds and are cancelled after it (streams get an error event,
    waiting requests a 503); returns once the worker thread has exited."""
    app = create_app(decoder, settings)
    server = _DrainingServer(uvicorn_config(app, settings, log_level), app.state.engine)
    # After a graceful shutdown uvicorn re-raises the signal it caught, with the handler that was in place
    # before it started. Ignoring SIGTERM at that point makes a drained server exit 0 instead of dying by
    # the signal; SIGINT keeps Python's handler (KeyboardInterrupt: the CLI reports "interrupted").
    previous = signal.signal(signal.SIGTERM, _ignore)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass
