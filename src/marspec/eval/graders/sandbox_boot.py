"""The sandbox's first stage, run in the child as ``python -I -S sandbox_boot.py CONFIG_JSON`` (by path:
isolated mode, no site-packages, standard library only; see :mod:`marspec.eval.graders.sandbox`).

Trusted code that isolates the process before any model output runs: as root it enters new mount,
network, IPC and UTS namespaces, mounts empty tmpfs over the world-writable directories and the user's
home, binds the work directory (and the interpreter's install tree, read-only) back in, sets
``no_new_privs`` and the resource limits, and switches to a random unused uid/gid that owns only the
work directory; as another user it tries a user + network namespace instead. It reports what it
enforced as one ``MARSPEC_SANDBOX {json}`` line on stderr, then execs the second stage
(:mod:`marspec.eval.graders.sandbox_runner`, copied into the work directory as ``runner.py``).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import stat
import sys
from typing import Any, NoReturn

RUNNER_FILE = "runner.py"  # the second stage, in the work directory

# Linux's clone flags (unshare(2)) and mount flags (mount(2)).
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
# Directories any user may write to; hidden under an empty tmpfs that keeps their sticky, open mode.
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
HIDDEN = (*WORLD_WRITABLE, "/dev/mqueue")


def fail(rc: int, message: str) -> NoReturn:
    """Report a setup failure on stderr and exit with the sandbox's own status ``rc``."""
    os.write(2, ("MARSPEC_SANDBOX_ERROR " + message + "\n").encode("utf-8", "backslashreplace"))
    os._exit(rc)


def first_closed(path: str) -> str | None:
    """The topmost directory on the way to ``path`` that other users cannot enter, or None."""
    cur = "/"
    for part in [p for p in path.split("/") if p]:
        cur = os.path.join(cur, part)
        mode = os.stat(cur).st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return cur
    return None


def under(path: str, top: str) -> bool:
    """Whether ``path`` is ``top`` or inside it (paths already resolved)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def dirs_to_hide(home: str | None, prefix: str) -> list[str]:
    """The directories to cover with an empty tmpfs: the world-writable ones, the user's home and the
    first directory on the way to the interpreter's tree that others cannot enter; outermost only."""
    hide = [
        os.path.realpath(d)
        for d in (*HIDDEN, home)
        if d and d != "/" and os.path.isdir(d) and not os.path.islink(d)
    ]
    closed = first_closed(prefix)
    if closed:
        hide.append(closed)
    # Outermost first; ties by name, since a set's order (string hashes) changes from process to process.
    hide = sorted(set(hide), key=lambda d: (len(d), d))
    return [d for i, d in enumerate(hide) if not any(under(d, h) for h in hide[:i])]


def user_tasks(uid: int) -> int:
    """How many tasks (threads) this user runs now, as RLIMIT_NPROC counts them."""
    mine = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat("/proc/" + pid).st_uid == uid:
                    mine += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return mine


def resource_limits(cfg: dict[str, Any], nproc: int) -> dict[str, int]:
    """The RLIMIT_* soft limits to set, by name."""
    return {
        "AS": cfg["mem"],
        "CPU": cfg["cpu"],
        "FSIZE": cfg["fsize"],
        "NOFILE": cfg["nofile"],
        "CORE": 0,
        "NPROC": nproc,
    }


class _Libc:
    """The few libc calls the standard library does not wrap."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
        self.lib.unshare.argtypes = (ctypes.c_int,)
        self.lib.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4

    def mount(
        self, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
    ) -> None:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else os.fsencode(s)

        if self.lib.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    def unshare(self, flags: int) -> bool:
        return self.lib.unshare(flags) == 0

    def no_new_privs(self) -> bool:
        return self.lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


def _hide_as_root(libc: _Libc, work: str, prefix: str, home: str | None) -> list[str]:
    """In a new mount namespace: empty tmpfs over :func:`dirs_to_hide`, then the work directory and the
    interpreter's tree bound back in (the tree read-only). Returns the hidden directories."""
    libc.mount(None, "/", None, REC | PRIVATE)
    hide = dirs_to_hide(home, prefix)
    keep = [(p, os.open(p, os.O_PATH)) for p in (work, prefix) if any(under(p, h) for h in hide)]
    for d in hide:
        mode = "1777" if d in WORLD_WRITABLE else "0755"
        libc.mount("tmpfs", d, "tmpfs", NOSUID | NODEV, "size=8m,mode=" + mode)
    for path, fd in keep:
        os.makedirs(path, mode=0o755, exist_ok=True)
        libc.mount(f"/proc/self/fd/{fd}", path, None, BIND | REC)
        if path == prefix:
            libc.mount(None, path, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
        os.close(fd)
    os.chdir(work)
    return hide


def main(argv: list[str]) -> NoReturn:
    cfg = json.loads(argv[1])
    rc_sandbox = cfg["rc_sandbox"]
    report: dict[str, Any] = {
        "user_switched": False,
        "network_namespace": False,
        "mount_namespace": False,
        "user_namespace": False,
        "no_new_privs": False,
        "hidden_paths": [],
        "rlimits": {},
        "python_guard": True,
    }
    libc = _Libc()
    work = os.path.realpath(os.getcwd())
    python, prefix, home = cfg["python"], cfg["prefix"], cfg["home"]
    root = os.geteuid() == 0
    # RLIMIT_NPROC counts all of this user's tasks: as a user, allow only a few more than exist now.
    nproc = 1 if root else user_tasks(os.getuid()) + 8

    if root:
        if libc.unshare(NEWNS | NEWNET | NEWIPC | NEWUTS):
            report["network_namespace"] = True
            try:
                report["hidden_paths"] = _hide_as_root(libc, work, prefix, home)
            except OSError as e:
                fail(rc_sandbox, f"mount namespace setup failed: {e}")
            report["mount_namespace"] = True
    elif libc.unshare(NEWUSER | NEWNET):
        report["user_namespace"] = report["network_namespace"] = True

    report["no_new_privs"] = libc.no_new_privs()

    switch = root and cfg["uid"] is not None
    if switch:
        # The sandbox user must be able to run the interpreter and read its standard library.
        exe_mode = os.stat(python).st_mode
        switch = bool(
            first_closed(python) is None
            and first_closed(prefix) is None
            and exe_mode & stat.S_IXOTH
            and exe_mode & stat.S_IROTH
        )

    limits = resource_limits(cfg, nproc if (switch or not root) else 64)
    for name, value in limits.items():
        hard = value + 1 if name == "CPU" else value  # SIGXCPU at the soft limit, SIGKILL a second later
        try:
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, hard))
            report["rlimits"][name] = value
        except (ValueError, OSError) as e:
            fail(rc_sandbox, f"cannot set RLIMIT_{name}: {e}")

    if switch:
        try:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        except OSError as e:
            fail(rc_sandbox, f"cannot switch to the sandbox user: {e}")
        report["user_switched"] = True
    report["uid"] = os.getuid()

    os.write(2, ("MARSPEC_SANDBOX " + json.dumps(report) + "\n").encode())
    try:
        os.execve(python, [python, "-I", "-S", "-B", RUNNER_FILE], dict(os.environ))
    except OSError as e:
        fail(rc_sandbox, f"cannot start {python}: {e}")


if __name__ == "__main__":
    main(sys.argv)
