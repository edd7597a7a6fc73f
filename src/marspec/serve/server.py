"""Running the app under uvicorn: the listening socket, and a graceful drain on SIGTERM."""

from __future__ import annotations

import signal
import socket
from types import FrameType

import uvicorn

from marspec.api import Decoder
from marspec.errors import MarspecError
from marspec.serve.app import create_app
from marspec.serve.engine import Engine
from marspec.serve.settings import ServerSettings

# uvicorn waits this much longer than the engine's grace for connections to close before cancelling
# them: by then the engine has ended every job, so this only catches a client that stopped reading.
UVICORN_EXTRA_GRACE_S = 10.0


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` now (port 0 picks a free one), so that a taken port is reported before the
    models spend seconds loading. uvicorn starts listening on it once the app is up."""
    if not 0 <= port <= 65535:
        raise MarspecError(f"--port must be in [0, 65535], got {port}")
    try:
        families = [info[0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        # "localhost" may resolve to ::1 first; IPv4 is what most clients try first.
        family = socket.AF_INET if socket.AF_INET in families else families[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise MarspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


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
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=settings.shutdown_grace + UVICORN_EXTRA_GRACE_S,
    )
    server = _DrainingServer(config, app.state.engine)
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
