"""LoadWatch (marspec.eval.contention) against the real kernel counters: another process spinning on a
core is seen (about 1.0 other cores), and this process's own spinning is not counted. The unit tests
(tests/test_contention.py) check the same arithmetic on scripted counters; this runs it on the machine,
where the result depends on what else runs, so it belongs here and not in the test suite. Run it on a
quiet machine (Linux: /proc/stat); exits 1 if a check fails.

    PYTHONPATH=src python benchmarks/load_watch.py
"""

from __future__ import annotations

import subprocess
import sys
import time

from marspec.eval.contention import LoadWatch

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def other_process_seen() -> float | None:
    """Other cores while a second Python process spins for the whole watched second."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)])
    try:
        time.sleep(0.3)  # past the interpreter's start
        with LoadWatch() as load:
            time.sleep(1.0)
    finally:
        spinner.wait()
    return load.other_cores


def idle_then_spinning() -> tuple[float | None, float | None]:
    """Other cores over an idle second of this process, then over a second it spins itself."""
    with LoadWatch() as idle:
        time.sleep(1.0)
    with LoadWatch() as load:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            pass
    return idle.other_cores, load.other_cores


def main() -> int:
    seen = other_process_seen()
    print(f"another process spinning: {seen} other cores (expected about 1.0)")
    idle, spinning = idle_then_spinning()
    print(f"this process idle: {idle} other cores; this process spinning: {spinning} (expected the same)")
    failed = seen is None or seen <= 0.5
    # Counting its own work would add about 1.0; other work starting between the two windows adds some.
    failed |= idle is None or spinning is None or spinning >= idle + 0.5
    print("FAILED" if failed else "ok")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
