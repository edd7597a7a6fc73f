"""Peak memory and wall time of one ``marspec`` command, read from the command's own process.

The command runs in a fresh Python process that reports its own ``VmHWM`` (peak resident set) from
/proc when it ends. ``ru_maxrss`` (GNU time's figure, and ``resource``'s) is not used: a process started
by exec inherits its parent's peak in it, so a small command run from a large parent (pytest) reads
large. Linux only (/proc).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

# Runs the marspec CLI and prints this process's own peak on stderr however the command ends.
_CHILD = (
    "import sys\n"
    "from marspec.cli import app\n"
    "try:\n"
    "    app(sys.argv[1:])\n"
    "finally:\n"
    "    hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
    "    print('peak_kib', hwm.split()[1], file=sys.stderr)\n"
)
_PEAK = "peak_kib "


@dataclass(frozen=True)
class Measured:
    returncode: int
    stdout: str
    stderr: str  # the command's own, without the peak line
    peak_gib: float | None  # None if the command died before reporting it
    wall_s: float


def run_measured(argv: list[str], timeout: float | None = None) -> Measured:
    """Run ``marspec ARGV`` in a child process: its exit status, output, own peak memory and wall time."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - started
    lines = out.stderr.splitlines(keepends=True)
    peaks = [line for line in lines if line.startswith(_PEAK)]
    return Measured(
        returncode=out.returncode,
        stdout=out.stdout,
        stderr="".join(line for line in lines if not line.startswith(_PEAK)),
        peak_gib=int(peaks[-1].removeprefix(_PEAK)) / 2**20 if peaks else None,
        wall_s=wall,
    )
