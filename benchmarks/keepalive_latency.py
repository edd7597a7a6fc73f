"""Latency of requests after the first on a kept-alive connection, with and without TCP_NODELAY on the
accepted sockets (issue 82), A/B in one process.

Two uvicorn servers of the same app (the tiny random pair: only `GET /v1/models` is timed, no model work)
listen on loopback: one on a socket made as `marspec serve` makes it (`bind_socket`: IPPROTO_TCP named, so
asyncio sets TCP_NODELAY on each accepted socket), one on a socket made without the protocol number, as
before. One keep-alive client per server sends `--requests` GETs, alternating between the two servers;
the median and p90 of each request after the first are printed.

    python benchmarks/keepalive_latency.py --requests 40
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

from marspec.selftest.tiny import tiny_decoder
from marspec.serve.app import create_app
from marspec.serve.server import bind_socket, uvicorn_config
from marspec.serve.settings import ServerSettings


def serve(sock: socket.socket) -> uvicorn.Server:
    decoder = tiny_decoder(Path(tempfile.mkdtemp()), torch.device("cpu"))
    settings = ServerSettings("tiny", max_batch=1)
    server = uvicorn.Server(uvicorn_config(create_app(decoder, settings), settings, "warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server


def old_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # protocol 0: asyncio leaves Nagle on
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    socks = {"nodelay (bind_socket)": bind_socket("127.0.0.1", 0), "before (protocol 0)": old_socket()}
    servers = {name: serve(sock) for name, sock in socks.items()}
    clients = {
        name: httpx.Client(base_url=f"http://127.0.0.1:{s.getsockname()[1]}") for name, s in socks.items()
    }
    times: dict[str, list[float]] = {name: [] for name in socks}
    for _ in range(args.requests):
        for name, client in clients.items():
            start = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            times[name].append(time.perf_counter() - start)
    for name, measured in times.items():
        later = sorted(measured[1:])
        p90 = later[int(0.9 * (len(later) - 1))]
        print(
            f"{name}: first {measured[0] * 1e3:.1f} ms, later median "
            f"{statistics.median(later) * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms ({len(later)} requests)"
        )
    for server in servers.values():
        server.should_exit = True


if __name__ == "__main__":
    main()
