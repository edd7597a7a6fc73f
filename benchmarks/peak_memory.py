r"""Peak memory (the command's own VmHWM, not ru_maxrss: see marspec.eval.peak_memory) and wall time of
one ``marspec`` command.

    python benchmarks/peak_memory.py generate "Write a Python function that reverses a string." \
        --target-quant int4 --draft-quant int4 --max-new-tokens 64 --threads 2

Prints the command's output, then one JSON line ``{"argv", "rc", "peak_gib", "peak_gb", "wall_s"}``;
``--json PATH`` also writes it there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _common import write_json  # this folder's shared helpers

from marspec.eval.peak_memory import run_measured


def main() -> int:
    argv = sys.argv[1:]
    target = None
    if len(argv) >= 2 and argv[0] == "--json":
        target, argv = Path(argv[1]), argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    measured = run_measured(argv)
    sys.stdout.write(measured.stdout)
    sys.stderr.write(measured.stderr)
    peak = measured.peak_gib
    result = {
        "argv": argv,
        "rc": measured.returncode,
        "peak_gib": None if peak is None else round(peak, 3),
        "peak_gb": None if peak is None else round(peak * 2**30 / 1e9, 3),
        "wall_s": round(measured.wall_s, 1),
    }
    print(json.dumps(result))
    if target is not None:
        write_json(target, result)
    return int(measured.returncode != 0)


if __name__ == "__main__":
    sys.exit(main())
