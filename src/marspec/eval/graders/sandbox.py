"""HumanEval: running a program and its tests in a sandbox process.

HumanEval programs are model output, so they never run in this process. :func:`run_humaneval` writes the
program and its test into a fresh temporary directory and starts two short-lived interpreters in a new
session (process group):

1. a *boot* stage (trusted code, passed with ``-c``) that, in the child, isolates the process: as root it
   enters new mount, network, IPC and UTS namespaces, mounts empty tmpfs over the world-writable
   directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ``/dev/mqueue``) and over the user's
   home, binds the work directory (and the interpreter's install tree, read-only) back in, sets
   ``no_new_privs`` and the resource limits, and switches to a random unused uid/gid that owns only the
   work directory; as another user it tries a user + network namespace instead. It then execs
2. the *runner* stage: the base interpreter with ``-I -S -B`` (stdlib only), which installs a Python-level
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
from typing import Any, Literal

from marspec.errors import MarspecError
from marspec.eval.graders.humaneval_code import check_entry_point

Status = Literal["passed", "failed", "timeout", "error"]

MEMORY_LIMIT_BYTES = 1 << 30  # RLIMIT_AS of the sandboxed interpreter
FILE_SIZE_LIMIT_BYTES = 4 << 20  # RLIMIT_FSIZE: any file it writes, its captured stdout/stderr included
OPEN_FILES_LIMIT = 64  # RLIMIT_NOFILE
_RC_FAILED, _RC_ERROR, _RC_SANDBOX = 10, 11, 12
_OUTPUT_TAIL = 64 * 1024


@dataclass(frozen=True)
class HumanEvalOutcome:
    """``passed``: check() returned. ``failed``: a test failed, or the program crashed or was killed
    while tested. ``timeout``: wall-clock or CPU limit hit. ``error``: the program (or the test) does not
    compile, raises while being defined, or does not define the entry point; or the sandbox could not be
    set up. ``detail`` is one line saying what happened."""

    passed: bool
    status: Status
    detail: str


_BOOT = r"""
import ctypes, json, os, resource, stat, sys

cfg = json.loads(sys.argv[1])
report = {"user_switched": False, "network_namespace": False, "mount_namespace": False,
          "user_namespace": False, "no_new_privs": False, "hidden_paths": [], "rlimits": {},
          "python_guard": True}

def fail(msg):
    os.write(2, ("MARSPEC_SANDBOX_ERROR " + msg + "\n").encode("utf-8", "backslashreplace"))
    os._exit(cfg["rc_sandbox"])

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
libc.unshare.argtypes = (ctypes.c_int,)
libc.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s: %s" % (target, os.strerror(err)))

def first_closed(path):
    # The topmost directory on the way to path that other users cannot enter, or None.
    cur = "/"
    for part in [p for p in path.split("/") if p]:
        cur = os.path.join(cur, part)
        mode = os.stat(cur).st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return cur
    return None

def under(path, top):
    return path == top or path.startswith(top.rstrip("/") + "/")

work = os.path.realpath(os.getcwd())
python, prefix, home = cfg["python"], cfg["prefix"], cfg["home"]
root = os.geteuid() == 0

nproc = 1
if not root:
    # RLIMIT_NPROC counts all of this user's tasks: allow only a few more than exist now.
    mine = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat("/proc/" + pid).st_uid == os.getuid():
                    mine += len(os.listdir("/proc/%s/task" % pid))
            except OSError:
                pass
    nproc = mine + 8

if root:
    if libc.unshare(NEWNS | NEWNET | NEWIPC | NEWUTS) == 0:
        report["network_namespace"] = True
        try:
            mount(None, "/", None, REC | PRIVATE)
            hide = []
            for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue", home):
                if d and d != "/" and os.path.isdir(d) and not os.path.islink(d):
                    hide.append(os.path.realpath(d))
            closed = first_closed(prefix)
            if closed:
                hide.append(closed)
            hide = sorted(set(hide), key=len)
            hide = [d for i, d in enumerate(hide) if not any(under(d, h) for h in hide[:i])]
            keep = [(p, os.open(p, os.O_PATH)) for p in (work, prefix) if any(under(p, h) for h in hide)]
            for d in hide:
                mode = "1777" if d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") else "0755"
                mount("tmpfs", d, "tmpfs", NOSUID | NODEV, "size=8m,mode=" + mode)
            for path, fd in keep:
                os.makedirs(path, mode=0o755, exist_ok=True)
                mount("/proc/self/fd/%d" % fd, path, None, BIND | REC)
                if path == prefix:
                    mount(None, path, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
                os.close(fd)
            os.chdir(work)
        except OSError as e:
            fail("mount namespace setup failed: %s" % e)
        report["mount_namespace"] = True
        report["hidden_paths"] = hide
elif libc.unshare(NEWUSER | NEWNET) == 0:
    report["user_namespace"] = report["network_namespace"] = True

report["no_new_privs"] = libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS

switch = root and cfg["uid"] is not None
if switch:
    # The sandbox user must be able to run the interpreter and read its standard library.
    exe_mode = os.stat(python).st_mode
    switch = (first_closed(python) is None and first_closed(prefix) is None
              and exe_mode & stat.S_IXOTH and exe_mode & stat.S_IROTH)

limits = {"AS": cfg["mem"], "CPU": cfg["cpu"], "FSIZE": cfg["fsize"], "NOFILE": cfg["nofile"],
          "CORE": 0, "NPROC": nproc if (switch or not root) else 64}
for name, value in limits.items():
    hard = value + 1 if name == "CPU" else value  # SIGXCPU at the soft limit, SIGKILL a second later
    try:
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, hard))
        report["rlimits"][name] = value
    except (ValueError, OSError) as e:
        fail("cannot set RLIMIT_%s: %s" % (name, e))

if switch:
    try:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    except OSError as e:
        fail("cannot switch to the sandbox user: %s" % e)
    report["user_switched"] = True
report["uid"] = os.getuid()

os.write(2, ("MARSPEC_SANDBOX " + json.dumps(report) + "\n").encode())
try:
    os.execve(python, [python, "-I", "-S", "-B", "runner.py"], dict(os.environ))
except OSError as e:
    fail("cannot start %s: %s" % (python, e))
"""

_RUNNER = r"""
import builtins, errno, io, json, os, sys, traceback

_CFG = json.loads(__CFG__)
_write, _exit, _getpid, _kill = os.write, os._exit, os.getpid, os.kill
try:
    os.unlink(__file__)  # it holds the pass token
except OSError:
    pass
with open("candidate.py", encoding="utf-8") as _f:
    _PROGRAM = _f.read()
with open("test.py", encoding="utf-8") as _f:
    _TEST = _f.read()
_LINES = {"candidate.py": _PROGRAM.splitlines(), "test.py": _TEST.splitlines()}


def _finish(rc, summary):
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            s.flush()
        except BaseException:
            pass
    if rc == 0:
        _write(1, ("\n" + _CFG["token"] + "\n").encode())
    line = " ".join(str(summary).split())[:600]
    _write(2, ("\nMARSPEC_RESULT " + line + "\n").encode("utf-8", "backslashreplace"))
    _exit(rc)


def _describe(e):
    try:
        text = "%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__
    except BaseException:
        text = type(e).__name__
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        lines = _LINES.get(fr.filename)
        if lines is not None:
            src = lines[fr.lineno - 1].strip() if fr.lineno and 0 < fr.lineno <= len(lines) else ""
            return "%s at %s:%s%s" % (text, fr.filename, fr.lineno, (": " + src) if src else "")
    return text


def _install_guard():
    import _io
    import _posixsubprocess
    import _socket
    import socket

    work = os.path.realpath(os.getcwd())
    allowed = {"/dev/null"}
    real_realpath, real_readlink = os.path.realpath, os.readlink

    def deny(what):
        def blocked(*args, **kwargs):
            raise PermissionError(errno.EPERM, "sandbox: %s is not allowed" % what)
        return blocked

    def resolve(path, dir_fd=None):
        if isinstance(path, int):
            return None  # an already open file descriptor
        p = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(real_readlink("/proc/self/fd/%d" % dir_fd), p)
        return real_realpath(p)

    def check(path, dir_fd=None):
        r = resolve(path, dir_fd)
        if r is None or r in allowed or r == work or r.startswith(work + os.sep):
            return
        raise PermissionError(errno.EACCES, "sandbox: writing outside the work directory is not allowed",
                              os.fsdecode(os.fspath(path)))

    def writes(mode):
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    real_open = io.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if writes(mode):
            check(file)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            if writes(mode):
                check(file)
            super().__init__(file, mode, *args, **kwargs)

    io.FileIO = _io.FileIO = GuardedFileIO

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    real_os_open = os.open

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags:
            check(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    os.open = guarded_os_open

    def guard_paths(name, checked):
        # checked: (position of a path argument that is written, keyword naming its dir_fd)
        real = getattr(os, name, None)
        if real is None:
            return

        def guarded(*args, **kwargs):
            for i, dir_fd_kw in checked:
                if i < len(args):
                    check(args[i], kwargs.get(dir_fd_kw))
            return real(*args, **kwargs)

        setattr(os, name, guarded)

    for name in ("mkdir", "rmdir", "remove", "unlink", "chmod", "chown", "lchown", "truncate", "utime",
                 "mkfifo", "mknod", "removexattr", "setxattr", "chflags", "lchflags", "lchmod"):
        guard_paths(name, [(0, "dir_fd")])
    for name in ("rename", "replace", "link"):  # a hard link to an outside file would be a way out
        guard_paths(name, [(0, "src_dir_fd"), (1, "dst_dir_fd")])
    guard_paths("symlink", [(1, "dir_fd")])  # writes through links are checked on their real path

    for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp",
                 "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "killpg", "setsid",
                 "setpgid", "setpgrp", "pidfd_open"):
        if hasattr(os, name):
            setattr(os, name, deny("starting or controlling processes"))
    _posixsubprocess.fork_exec = deny("starting processes")

    def guarded_kill(pid, sig):
        if pid != _getpid():
            raise PermissionError(errno.EPERM, "sandbox: signalling other processes is not allowed")
        return _kill(pid, sig)

    os.kill = guarded_kill

    class NoSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "sandbox: network access is disabled")

    for mod in (socket, _socket):
        mod.socket = mod.SocketType = NoSocket
        for name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
            if hasattr(mod, name):
                setattr(mod, name, deny("network access"))


try:
    _install_guard()
except BaseException as _e:
    _finish(_CFG["rc_sandbox"], "sandbox guard failed: " + _describe(_e))

try:
    _program_code = compile(_PROGRAM, "candidate.py", "exec")
except BaseException as _e:
    _finish(_CFG["rc_error"], "program does not compile: " + _describe(_e))
try:
    _test_code = compile(_TEST, "test.py", "exec")
except BaseException as _e:
    _finish(_CFG["rc_error"], "test does not compile: " + _describe(_e))

_ns = {"__name__": "candidate", "__builtins__": builtins}
try:
    exec(_program_code, _ns)
except BaseException as _e:
    traceback.print_exc()
    _finish(_CFG["rc_error"], "program raised while being defined: " + _describe(_e))
_fn = _ns.get(_CFG["entry_point"])
if not callable(_fn):
    _finish(_CFG["rc_error"], "program does not define %s()" % _CFG["entry_point"])
try:
    exec(_test_code, _ns)
    _check = _ns.get("check")
    if not callable(_check):
        _finish(_CFG["rc_error"], "test defines no check(candidate) function")
    _check(_fn)
except BaseException as _e:
    traceback.print_exc()
    _finish(_CFG["rc_failed"], "test failed: " + _describe(_e))
_finish(0, "passed")
"""


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
            ("candidate.py", program),
            ("test.py", test),
            ("runner.py", _RUNNER.replace("__CFG__", repr(json.dumps(runner_cfg)), 1)),
        ):
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        if sandbox_id is not None:
            os.chown(work, sandbox_id, sandbox_id)
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": work, "TMPDIR": work}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg)],
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
