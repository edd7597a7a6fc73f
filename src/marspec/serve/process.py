"""Starting ``marspec serve`` as a child process and waiting until it answers (tests, load test, scripts)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

_LISTENING = re.compile(r"marspec serve: \S+ on (http://\S+:\d+)")


@dataclass
class ServerProcess:
    """A running ``marspec serve`` child; its stdout and stderr go to ``log_path``."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return _read(self.log_path)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (a graceful drain) and wait; return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def launch(args: list[str], log_path: Path, timeout: float = 300.0) -> ServerProcess:
    """Run ``marspec serve ARGS`` (pass ``--port 0`` for a free port) and return once ``/health`` answers
    200; raise RuntimeError with the server's log if it exits or is not healthy within ``timeout`` s."""
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "marspec.cli", "serve", *args], stdout=log, stderr=subprocess.STDOUT
    )
    log.close()  # the child holds its own copy
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"marspec serve exited with status {proc.returncode}:\n{_read(log_path)}")
        if url is None and (found := _LISTENING.search(_read(log_path))):
            url = found.group(1)
        if url is not None and _healthy(url):
            return ServerProcess(proc, url, log_path)
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"marspec serve was not healthy after {timeout:g} s:\n{_read(log_path)}")


def _read(path: Path) -> str:
    return path.read_text(errors="replace")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # refused while the models load; 503 raises HTTPError
        return False
