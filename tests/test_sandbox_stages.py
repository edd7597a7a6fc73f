"""The sandbox's two child programs as units: the boot stage's helpers (in this process; its namespaces
and limits are tested end to end in test_eval_graders.py) and the runner stage, run on its own as the boot
starts it (``python -I -S -B`` in a work directory), so its guard and exit codes are seen without the
namespaces that would also stop what it stops."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from marspec.eval.graders import sandbox_boot, sandbox_runner

RC_FAILED, RC_ERROR, RC_SANDBOX = 10, 11, 12
TEST = "def check(candidate):\n    assert candidate() == 1\n"

# --------------------------------------------------------------------------------------------------------
# The runner: helpers
# --------------------------------------------------------------------------------------------------------


def test_describe_names_the_line_of_the_program_that_raised() -> None:
    program = "x = 1\ndef f():\n    return 1 / 0\n"
    ns: dict = {}
    exec(compile(program, "candidate.py", "exec"), ns)
    with pytest.raises(ZeroDivisionError) as info:
        ns["f"]()
    sources = {"candidate.py": program.splitlines()}
    assert sandbox_runner.describe(info.value, sources) == (
        "ZeroDivisionError: division by zero at candidate.py:3: return 1 / 0"
    )
    # Raised outside the program and the test: the type and message only.
    assert sandbox_runner.describe(info.value, {}) == "ZeroDivisionError: division by zero"


def test_describe_survives_an_exception_whose_message_raises() -> None:
    class Nasty(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    assert sandbox_runner.describe(Nasty(), {}) == "Nasty"
    assert sandbox_runner.describe(AssertionError(), {}) == "AssertionError"


@pytest.mark.parametrize(
    ("mode", "writes"),
    [("r", False), ("rb", False), ("w", True), ("ab", True), ("x", True), ("r+", True), (None, False)],
)
def test_open_modes_that_write(mode: object, writes: bool) -> None:
    assert sandbox_runner.opens_for_writing(mode) is writes


def test_inside_the_work_directory_only() -> None:
    work = "/scratch/work"
    assert sandbox_runner.inside(work, work, set())
    assert sandbox_runner.inside(work + "/sub/file", work, set())
    assert not sandbox_runner.inside("/scratch/work2/file", work, set())  # a sibling sharing the prefix
    assert not sandbox_runner.inside("/scratch", work, set())
    assert sandbox_runner.inside("/dev/null", work, {"/dev/null"})
    assert sandbox_runner.inside(None, work, set())  # an already open file descriptor


# --------------------------------------------------------------------------------------------------------
# The runner: run as the boot stage starts it
# --------------------------------------------------------------------------------------------------------


def _run_runner(work: Path, program: str, test: str = TEST) -> tuple[int, str, str, str]:
    """Run the runner in ``work`` on ``program`` (defining f) and ``test``: (rc, stdout, stderr, token)."""
    token = uuid.uuid4().hex
    config = {
        "token": token,
        "entry_point": "f",
        "rc_failed": RC_FAILED,
        "rc_error": RC_ERROR,
        "rc_sandbox": RC_SANDBOX,
    }
    (work / sandbox_runner.PROGRAM_FILE).write_text(program)
    (work / sandbox_runner.TEST_FILE).write_text(test)
    (work / sandbox_runner.CONFIG_FILE).write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-B", sandbox_runner.__file__],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
    )
    return out.returncode, out.stdout, out.stderr, token


def _program(body: str) -> str:
    return "def f():\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"


def _result(stderr: str) -> str:
    return stderr.strip().splitlines()[-1].removeprefix("MARSPEC_RESULT ")


def test_a_passing_program_prints_the_token_last_and_exits_0(tmp_path: Path) -> None:
    # The settings file holds the token: the runner deletes it before the program runs.
    rc, stdout, stderr, token = _run_runner(tmp_path, _program("return 1"))
    assert rc == 0 and stdout.splitlines()[-1] == token and _result(stderr) == "passed"
    rc, stdout, _, token = _run_runner(
        tmp_path,
        _program(f"import os\nreturn 1 if not os.path.exists({sandbox_runner.CONFIG_FILE!r}) else 0"),
    )
    assert rc == 0 and token in stdout
    assert not (tmp_path / sandbox_runner.CONFIG_FILE).exists()


def test_a_failing_test_names_its_line(tmp_path: Path) -> None:
    rc, stdout, stderr, token = _run_runner(tmp_path, _program("return 2"))
    assert rc == RC_FAILED and token not in stdout
    assert _result(stderr) == "test failed: AssertionError at test.py:2: assert candidate() == 1"


@pytest.mark.parametrize(
    ("program", "needle"),
    [
        ("def f(:\n", "program does not compile: SyntaxError"),
        ("def g():\n    return 1\n", "program does not define f()"),
        ("raise ValueError('at import')\n", "program raised while being defined: ValueError: at import"),
    ],
)
def test_broken_programs_are_errors(tmp_path: Path, program: str, needle: str) -> None:
    rc, _, stderr, _ = _run_runner(tmp_path, program)
    assert rc == RC_ERROR and _result(stderr).startswith(needle), stderr


def test_a_test_without_check_is_an_error(tmp_path: Path) -> None:
    rc, _, stderr, _ = _run_runner(tmp_path, _program("return 1"), test="def verify(c):\n    pass\n")
    assert rc == RC_ERROR and _result(stderr) == "test defines no check(candidate) function"


def test_exiting_early_prints_no_token(tmp_path: Path) -> None:
    rc, stdout, _, token = _run_runner(tmp_path, _program("import os\nos._exit(0)"))
    assert rc == 0 and token not in stdout  # status 0 alone is not a pass: the parent wants the token
    rc, stdout, _, token = _run_runner(tmp_path, _program("import sys\nsys.exit(0)"))
    assert rc == RC_FAILED and token not in stdout


def test_the_guard_stops_writes_outside_the_work_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    outside = tmp_path / f"escape-{uuid.uuid4().hex}"
    for body in (
        f"open({str(outside)!r}, 'w').write('x')\nreturn 1",
        f"import os\nos.close(os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT))\nreturn 1",
        f"import os\nos.mkdir({str(outside)!r})\nreturn 1",
        # A link inside may be made; writing through it is checked where it leads.
        f"import os\nos.symlink({str(outside)!r}, 'link')\nopen('link', 'w').write('x')\nreturn 1",
    ):
        rc, _, stderr, _ = _run_runner(work, _program(body))
        assert rc == RC_FAILED and "PermissionError" in _result(stderr), stderr
        assert not outside.exists()
    rc, _, _, _ = _run_runner(work, _program("open('scratch.txt', 'w').write('x')\nreturn 1"))
    assert rc == 0 and (work / "scratch.txt").read_text() == "x"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("import subprocess\nsubprocess.run(['true'])\nreturn 1", "starting processes is not allowed"),
        ("import os\nos.system('true')\nreturn 1", "starting or controlling processes is not allowed"),
        ("import os\nos.kill(1, 0)\nreturn 1", "signalling other processes is not allowed"),
        ("import socket\nsocket.socket()\nreturn 1", "network access is disabled"),
        ("import socket\nsocket.getaddrinfo('localhost', 80)\nreturn 1", "network access is not allowed"),
    ],
)
def test_the_guard_stops_processes_signals_and_sockets(tmp_path: Path, body: str, needle: str) -> None:
    rc, _, stderr, _ = _run_runner(tmp_path, _program(body))
    assert rc == RC_FAILED and needle in _result(stderr), stderr


# --------------------------------------------------------------------------------------------------------
# The boot stage's helpers
# --------------------------------------------------------------------------------------------------------


def test_under_compares_whole_path_components() -> None:
    assert sandbox_boot.under("/tmp", "/tmp") and sandbox_boot.under("/tmp/a/b", "/tmp")
    assert not sandbox_boot.under("/tmpx", "/tmp") and not sandbox_boot.under("/", "/tmp")
    assert sandbox_boot.under("/anything", "/")


@pytest.fixture
def open_tree():
    """/tmp/X (0755) / open (0755) / closed (0700) / inner: a path other users cannot reach."""
    top = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        top.chmod(0o755)
        closed = top / "open" / "closed"
        (closed / "inner").mkdir(parents=True)
        (top / "open").chmod(0o755)
        closed.chmod(0o700)
        yield top
    finally:
        shutil.rmtree(top)


def test_first_closed_finds_the_directory_others_cannot_enter(open_tree: Path) -> None:
    if not os.stat("/tmp").st_mode & 0o001:
        pytest.skip("/tmp itself is closed to other users here")
    closed = open_tree / "open" / "closed"
    assert sandbox_boot.first_closed(str(closed / "inner")) == str(closed)
    assert sandbox_boot.first_closed(str(open_tree / "open")) is None


def test_dirs_to_hide_keeps_the_outermost_only(open_tree: Path) -> None:
    hide = sandbox_boot.dirs_to_hide(str(open_tree / "open"), sys.base_prefix)
    tmp = os.path.realpath("/tmp")
    assert tmp in hide
    # The home directory lies under /tmp here: the tmpfs over /tmp covers it already.
    assert not any(d.startswith(str(open_tree)) for d in hide)
    assert hide == sorted(hide, key=len) and len(set(hide)) == len(hide)
    for i, d in enumerate(hide):
        assert not any(sandbox_boot.under(d, h) for h in hide[:i])
    assert sandbox_boot.dirs_to_hide(None, sys.base_prefix) == hide  # no home to hide


def test_dirs_to_hide_is_the_same_list_in_every_process() -> None:
    # /var/tmp and /dev/shm have the same length: their order must not follow the string hashes, which
    # change with each process (PYTHONHASHSEED); a run of the compatibility pass once failed on that.
    code = (
        "import sys; from marspec.eval.graders import sandbox_boot as b; "
        "print(b.dirs_to_hide(None, sys.base_prefix))"
    )
    lists = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(12)
    }
    assert len(lists) == 1, lists


def test_resource_limits_name_every_limit_the_sandbox_sets() -> None:
    cfg = {"mem": 1 << 30, "cpu": 3, "fsize": 4 << 20, "nofile": 64}
    assert sandbox_boot.resource_limits(cfg, nproc=5) == {
        "AS": 1 << 30,
        "CPU": 3,
        "FSIZE": 4 << 20,
        "NOFILE": 64,
        "CORE": 0,
        "NPROC": 5,
    }


def test_user_tasks_counts_this_processes_threads() -> None:
    before = sandbox_boot.user_tasks(os.getuid())
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        # Other processes of this user may come and go meanwhile; three more threads of ours are seen.
        assert sandbox_boot.user_tasks(os.getuid()) >= 4 and before >= 1
    finally:
        stop.set()
        for w in workers:
            w.join()
