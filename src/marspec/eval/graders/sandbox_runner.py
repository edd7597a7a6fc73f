"""The sandbox's second stage: runs a HumanEval program and its test, behind a Python-level guard.

Started by :mod:`marspec.eval.graders.sandbox_boot` as ``python -I -S -B runner.py`` in the work
directory, which holds this file (copied there: the sandbox user may not be able to read marspec's own
install), ``candidate.py``, ``test.py`` and ``runner.json`` (the run's settings and pass token, deleted
as soon as they are read). Standard library only.

It installs the guard (no sockets, no process creation or signals to other processes, no file writes
outside the work directory), then compiles and runs the program, the test, and ``check(entry_point)``.
Only after ``check`` returns does it print the per-run random token, so a program that exits early is
not a pass. Its exit status says what happened (the codes are the parent's, in ``runner.json``) and its
last stderr line is ``MARSPEC_RESULT <one-line summary>``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

CONFIG_FILE = "runner.json"
PROGRAM_FILE, TEST_FILE = "candidate.py", "test.py"

# Taken before the program runs: it may replace the os module's functions.
_write, _exit, _getpid, _kill = os.write, os._exit, os.getpid, os.kill


def finish(rc: int, summary: str, token: str) -> NoReturn:
    """Flush the program's output, print ``token`` when it passed (``rc`` 0), the one-line summary, and
    exit with ``rc`` at once (no exit handlers of the program run)."""
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if s is not None:
                s.flush()
        except BaseException:
            pass
    if rc == 0:
        _write(1, ("\n" + token + "\n").encode())
    line = " ".join(str(summary).split())[:600]
    _write(2, ("\nMARSPEC_RESULT " + line + "\n").encode("utf-8", "backslashreplace"))
    _exit(rc)


def describe(e: BaseException, sources: dict[str, list[str]]) -> str:
    """One line for an exception: its type and message, and the innermost line of the program or the
    test (``sources``: lines by file name) where it was raised."""
    try:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except BaseException:
        text = type(e).__name__
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        lines = sources.get(fr.filename)
        if lines is not None:
            src = lines[fr.lineno - 1].strip() if fr.lineno and 0 < fr.lineno <= len(lines) else ""
            return f"{text} at {fr.filename}:{fr.lineno}" + (f": {src}" if src else "")
    return text


def opens_for_writing(mode: object) -> bool:
    """Whether an ``open`` mode string writes (w, a, x or +)."""
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def inside(resolved: str | None, work: str, allowed: set[str]) -> bool:
    """Whether a resolved path may be written: inside the work directory or one of ``allowed`` (None
    stands for an already open file descriptor)."""
    return resolved is None or resolved in allowed or resolved == work or resolved.startswith(work + os.sep)


def install_guard(work: str) -> None:
    """Patch this interpreter so the program cannot write outside ``work``, start or signal other
    processes, or open sockets. A program can undo it (it is Python); the boot stage's namespaces and
    limits are the barrier that holds when it does."""
    _guard_writes(_write_check(work))
    _guard_processes()
    _guard_network()


def deny(what: str) -> Callable[..., NoReturn]:
    """A replacement for a function the program may not call: it raises PermissionError naming ``what``."""

    def blocked(*args: Any, **kwargs: Any) -> NoReturn:
        raise PermissionError(errno.EPERM, f"sandbox: {what} is not allowed")

    return blocked


def _write_check(work: str) -> Callable[..., None]:
    """``check(path, dir_fd=None)``: raise PermissionError unless ``path`` (resolved as the system would,
    through links and ``dir_fd``) may be written. Holds the real path functions, taken before any guard."""
    allowed = {"/dev/null"}
    real_realpath, real_readlink = os.path.realpath, os.readlink

    def resolve(path: Any, dir_fd: int | None = None) -> str | None:
        if isinstance(path, int):
            return None  # an already open file descriptor
        p = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(real_readlink(f"/proc/self/fd/{dir_fd}"), p)
        return real_realpath(p)

    def check(path: Any, dir_fd: int | None = None) -> None:
        if not inside(resolve(path, dir_fd), work, allowed):
            raise PermissionError(
                errno.EACCES,
                "sandbox: writing outside the work directory is not allowed",
                os.fsdecode(os.fspath(path)),
            )

    return check


def _guard_writes(check: Callable[..., None]) -> None:
    """Every way to open a file for writing, and every os function that writes a path, calls ``check``."""
    import _io

    real_open = io.open

    def guarded_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if opens_for_writing(mode):
            check(file)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> None:
            if opens_for_writing(mode):
                check(file)
            super().__init__(file, mode, *args, **kwargs)

    io.FileIO = _io.FileIO = GuardedFileIO  # type: ignore[misc]

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    real_os_open = os.open

    def guarded_os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & write_flags:
            check(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    os.open = guarded_os_open

    def guard_paths(name: str, checked: list[tuple[int, str]]) -> None:
        # checked: (position of a path argument that is written, keyword naming its dir_fd)
        real = getattr(os, name, None)
        if real is None:
            return

        def guarded(*args: Any, **kwargs: Any) -> Any:
            for i, dir_fd_kw in checked:
                if i < len(args):
                    check(args[i], kwargs.get(dir_fd_kw))
            return real(*args, **kwargs)

        setattr(os, name, guarded)

    for name in ("mkdir", "rmdir", "remove", "unlink", "chmod", "chown", "lchown", "truncate", "utime",
                 "mkfifo", "mknod", "removexattr", "setxattr", "chflags", "lchflags", "lchmod"):  # fmt: skip
        guard_paths(name, [(0, "dir_fd")])
    for name in ("rename", "replace", "link"):  # a hard link to an outside file would be a way out
        guard_paths(name, [(0, "src_dir_fd"), (1, "dst_dir_fd")])
    guard_paths("symlink", [(1, "dir_fd")])  # writes through links are checked on their real path


def _guard_processes() -> None:
    """No process is started, and no signal sent to another process."""
    import _posixsubprocess

    for name in ("system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp",
                 "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "killpg", "setsid",
                 "setpgid", "setpgrp", "pidfd_open"):  # fmt: skip
        if hasattr(os, name):
            setattr(os, name, deny("starting or controlling processes"))
    _posixsubprocess.fork_exec = deny("starting processes")

    def guarded_kill(pid: int, sig: int) -> None:
        if pid != _getpid():
            raise PermissionError(errno.EPERM, "sandbox: signalling other processes is not allowed")
        return _kill(pid, sig)

    os.kill = guarded_kill


def _guard_network() -> None:
    """No socket is made, and no name looked up."""
    import _socket
    import socket

    class NoSocket(_socket.socket):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PermissionError(errno.EACCES, "sandbox: network access is disabled")

    for mod in (socket, _socket):
        mod.socket = mod.SocketType = NoSocket  # type: ignore[misc]
        for name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo",
                     "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):  # fmt: skip
            if hasattr(mod, name):
                setattr(mod, name, deny("network access"))


def main() -> NoReturn:
    with open(CONFIG_FILE, encoding="utf-8") as f:
        cfg = json.load(f)
    with contextlib.suppress(OSError):
        os.unlink(CONFIG_FILE)  # it holds the pass token
    token, entry_point = cfg["token"], cfg["entry_point"]
    rc_failed, rc_error, rc_sandbox = cfg["rc_failed"], cfg["rc_error"], cfg["rc_sandbox"]
    with open(PROGRAM_FILE, encoding="utf-8") as f:
        program = f.read()
    with open(TEST_FILE, encoding="utf-8") as f:
        test = f.read()
    sources = {PROGRAM_FILE: program.splitlines(), TEST_FILE: test.splitlines()}

    try:
        install_guard(os.path.realpath(os.getcwd()))
    except BaseException as e:
        finish(rc_sandbox, "sandbox guard failed: " + describe(e, sources), token)

    try:
        program_code = compile(program, PROGRAM_FILE, "exec")
    except BaseException as e:
        finish(rc_error, "program does not compile: " + describe(e, sources), token)
    try:
        test_code = compile(test, TEST_FILE, "exec")
    except BaseException as e:
        finish(rc_error, "test does not compile: " + describe(e, sources), token)

    ns: dict[str, Any] = {"__name__": "candidate", "__builtins__": builtins}
    try:
        exec(program_code, ns)
    except BaseException as e:
        traceback.print_exc()
        finish(rc_error, "program raised while being defined: " + describe(e, sources), token)
    fn = ns.get(entry_point)
    if not callable(fn):
        finish(rc_error, f"program does not define {entry_point}()", token)
    try:
        exec(test_code, ns)
        check = ns.get("check")
        if not callable(check):
            finish(rc_error, "test defines no check(candidate) function", token)
        check(fn)
    except BaseException as e:
        traceback.print_exc()
        finish(rc_failed, "test failed: " + describe(e, sources), token)
    finish(0, "passed", token)


if __name__ == "__main__":
    main()
