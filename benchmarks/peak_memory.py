r"""Peak memory and wall time of one ``marspec`` command, read from the command's own process.

The command runs in a fresh Python process that reports its own ``VmHWM`` (peak resident set) from
/proc when it ends. GNU time's and ``resource``'s ``ru_maxrss`` are not used: a process started by exec
inherits its parent's peak in that figure, so a small command run from a large parent reads large.

    python benchmarks/peak_memory.py generate "Write a Python function that reverses a string." \
        --target-quant int4 --draft-quant int4 --max-new-tokens 64 --threads 2

Prints one JSON line: ``{"argv": [...], "rc": ..., "peak_gb": ..., "wall_s": ...}`` (GB = 1e9 bytes);
``--json PATH`` also writes it there. Linux only (/proc).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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


def measure(argv: list[str]) -> dict[str, object]:
    """Run ``marspec ARGV`` in a child process; its exit status, own peak memory and wall time."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, *argv], stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    sys.stderr.write(out.stderr)
    peaks = [line.split()[1] for line in out.stderr.splitlines() if line.startswith("peak_kib ")]
    peak_gb = int(peaks[-1]) * 1024 / 1e9 if peaks else None
    return {"argv": argv, "rc": out.returncode, "peak_gb": peak_gb, "wall_s": round(wall, 1)}


def main() -> int:
    argv = sys.argv[1:]
    target = None
    if len(argv) >= 2 and argv[0] == "--json":
        target, argv = Path(argv[1]), argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    result = measure(argv)
    print(json.dumps(result))
    if target is not None:
        target.write_text(json.dumps(result, indent=2) + "\n")
    return int(result["rc"] != 0)


if __name__ == "__main__":
    sys.exit(main())
