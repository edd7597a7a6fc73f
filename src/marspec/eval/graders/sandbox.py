"""HumanEval: running a program and its tests in a sandbox process.

HumanEval programs are model output, so they never run in this process. :func:`run_humaneval` writes the
program and its test into a fresh temporary directory and starts two short-lived interpreters in a new
session (process group):

1. a *boot* stage (trusted code, :mod:`marspec.eval.graders.sandbox_boot`, run by path in isolated mode,
   ``python -I -S``) that, in the child, isolates the process: as root it
   enters new mount, network, IPC and UTS namespaces, mounts empty tmpfs over the world-writable
   directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ``/dev/mqueue``) and over the user's
   home, binds the work directory (and the interpreter's install tree, read-only) back in, sets
   ``no_new_privs`` and the resource limits, and switches to a random unused uid/gid that owns only the
   work directory; as another user it tries a user + network namespace instead. It then execs
2. the *runner* stage (:mod:`marspec.eval.graders.sandbox_runner`, copied into the work directory, which
   the sandbox user can read, as ``runner.py``): the base interpreter with ``-I -S -B`` (stdlib only),
   which installs a Python-level
   guard (no sockets, no process creation or signals to other processes, no file writes outside the work
   directory), then compiles and runs the program, the test, and ``check(entry_point)``. Only after
   ``check`` returns does it print a per-run random token, so a program that exits early is not a pass.

The parent enforces the wall-clock timeout by killing the whole process group. See :func:`sandbox_report`
for what was actually enforced on this machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from marspec.errors import MarspecError
from marspec.eval.graders import sandbox_boot, sandbox_runner
from marspec.eval.graders.humaneval_code import check_entry_point

Status = Literal["passed", "failed", "timeout", "error"]

MEMORY_LIMIT_BYTES = 1 << 30  # RLIMIT_AS of the sandboxed interpreter
FILE_SIZE_LIMIT_BYTES = 4 << 20  # RLIMIT_FSIZE: any file it writes, its captured stdout/stderr included
OPEN_FILES_LIMIT = 64  # RLIMIT_NOFILE
_RC_FAILED, _RC_ERROR, _RC_SANDBOX = 10, 11, 12
_OUTPUT_TAIL = 64 * 1024
# The two stages' programs, modules of this package run as files (their imports are the stdlib's only).
_BOOT_PATH = Path(sandbox_boot.__file__)
_RUNNER_PATH = Path(sandbox_runner.__file__)


@dataclass(frozen=True)
class HumanEvalOutcome:
    """``passed``: check() returned. ``failed``: a test failed, or the program crashed or was killed
    while tested. ``timeout``: wall-clock or CPU limit hit. ``error``: the program (or the test) does not
    compile, raises while being defined, or does not define the entry point; or the sandbox could not be
    set up. ``detail`` is one line saying what happened."""

    passed: bool
    status: Status
    detail: str


def _interpreter() -> tuple[str, str]:
    """The base interpreter (outside any venv: the sandbox gets the standard library only) and its prefix."""
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return python, os.path.realpath(sys.base_prefix)


def _tail(f: Any, limit: int = _OUTPUT_TAIL) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", "replace")


def _run(program: str, test: str, entry_point: str, timeout_s: float) -> tuple[HumanEvalOutcome, dict]:
    check_entry_point(entry_point)
    if not isinstance(program, str) or not isinstance(test, str):
        raise MarspecError("run_humaneval needs the program and the test as strings")
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise MarspecError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    token = secrets.token_hex(16)
    python, prefix = _interpreter()
    root = os.geteuid() == 0
    sandbox_id = 1_000_000 + secrets.randbelow(1_000_000_000) if root else None
    cfg = {
        "python": python,
        "prefix": prefix,
        "home": os.path.realpath(os.path.expanduser("~")),
        "uid": sandbox_id,
        "gid": sandbox_id,
        "mem": MEMORY_LIMIT_BYTES,
        "cpu": math.ceil(timeout_s) + 1,
        "fsize": FILE_SIZE_LIMIT_BYTES,
        "nofile": OPEN_FILES_LIMIT,
        "rc_sandbox": _RC_SANDBOX,
    }
    runner_cfg = {
        "token": token,
        "entry_point": entry_point,
        "rc_failed": _RC_FAILED,
        "rc_error": _RC_ERROR,
        "rc_sandbox": _RC_SANDBOX,
    }
    work = tempfile.mkdtemp(prefix="marspec_he_")
    try:
        for name, text in (
            (sandbox_runner.PROGRAM_FILE, program),
            (sandbox_runner.TEST_FILE, test),
            (sandbox_boot.RUNNER_FILE, _RUNNER_PATH.read_text(encoding="utf-8")),
            (sandbox_runner.CONFIG_FILE, json.dumps(runner_cfg)),
        ):
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        if sandbox_id is not None:
            os.chown(work, sandbox_id, sandbox_id)
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_BOOT_PATH), json.dumps(cfg)],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                close_fds=True,
                start_new_session=True,
            )
            try:
                timed_out = not _wait_unreaped(proc.pid, timeout_s)
            finally:
                # Kill whatever is left of the group while its leader is still unreaped, so the group id
                # cannot have been reused by an unrelated process.
                _kill_group(proc.pid)
                rc = proc.wait()
            stdout, stderr = _tail(out), _tail(err)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _outcome(rc, timed_out, timeout_s, token, stdout, stderr), _report(stderr)


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until the child exits, without reaping it; False if ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.01)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _report(stderr: str) -> dict:
    for line in stderr.splitlines():
        if line.startswith("MARSPEC_SANDBOX "):
            try:
                return json.loads(line[len("MARSPEC_SANDBOX ") :])
            except ValueError:
                break
    return {}


def _outcome(rc: int, timed_out: bool, timeout_s: float, token: str, stdout: str, stderr: str):
    summary = ""
    for line in stderr.splitlines():
        if line.startswith(("MARSPEC_RESULT ", "MARSPEC_SANDBOX_ERROR ")):
            summary = line.split(" ", 1)[1]
    if timed_out:
        return HumanEvalOutcome(False, "timeout", f"timed out after {timeout_s:g} s (wall clock)")
    if rc == 0 and token in stdout.splitlines():
        return HumanEvalOutcome(True, "passed", "passed")
    if rc == _RC_FAILED:
        return HumanEvalOutcome(False, "failed", summary or "test failed")
    if rc == _RC_ERROR:
        return HumanEvalOutcome(False, "error", summary or "program error")
    if rc == _RC_SANDBOX:
        return HumanEvalOutcome(False, "error", f"sandbox: {summary}" if summary else "sandbox setup failed")
    if rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return HumanEvalOutcome(False, "timeout", "CPU time limit exceeded")
        if sig == signal.SIGXFSZ:
            return HumanEvalOutcome(False, "failed", "file size limit exceeded")
        if sig == signal.SIGKILL:
            return HumanEvalOutcome(False, "failed", "killed by SIGKILL (out of memory or CPU hard limit)")
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return HumanEvalOutcome(False, "failed", f"killed by {name}")
    if rc == 0:
        return HumanEvalOutcome(False, "failed", "the program exited before the tests finished")
    tail = stderr.strip().splitlines()[-1:] if stderr.strip() else []
    return HumanEvalOutcome(False, "failed", summary or f"exited with status {rc} {' '.join(tail)}".strip())


def run_humaneval(program: str, test: str, entry_point: str, timeout_s: float = 10.0) -> HumanEvalOutcome:
    """Run ``program`` (which defines ``entry_point``), then ``test``'s ``check(entry_point)``, sandboxed.

    ``timeout_s`` bounds the wall-clock time of the whole child (start-up included); the CPU-time limit
    is ``ceil(timeout_s) + 1`` s. Memory is capped at :data:`MEMORY_LIMIT_BYTES` of address space, written
    files (stdout/stderr included) at :data:`FILE_SIZE_LIMIT_BYTES` each. The program sees the standard
    library only, cannot start processes or threads (as root), and cannot use the network.
    """
    return _run(program, test, entry_point, timeout_s)[0]


@cache
def sandbox_report() -> dict:
    """What the sandbox enforces on this machine, from running a trivial program once.

    Keys: ``user_switched`` (runs as a random unused uid), ``uid``, ``network_namespace``,
    ``mount_namespace``, ``user_namespace``, ``no_new_privs``, ``hidden_paths`` (replaced by empty tmpfs),
    ``rlimits``, ``python_guard``; ``outcome`` is the trivial program's status (``"passed"`` when the
    sandbox works).
    """
    outcome, report = _run("def f():\n    return 1\n", "def check(c):\n    assert c() == 1\n", "f", 30.0)
    return {**report, "outcome": outcome.status, "detail": outcome.detail}
