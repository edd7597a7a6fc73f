"""Graders: GSM8K answers, HumanEval code extraction and the sandbox, chrF / exact match."""

from __future__ import annotations

import ast
import os
import socket
import textwrap
import time
import uuid

import pytest

from marspec.errors import MarspecError
from marspec.eval.datasets import load_task
from marspec.eval.graders import (
    chrf,
    exact_match,
    extract_code,
    extract_gsm8k_answer,
    grade_gsm8k,
    normalize_number,
    run_humaneval,
    sandbox_report,
)

# --------------------------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $18.\n#### 18", "18"),  # strict format
        ("#### 3\nThen, for 99 more days...", "3"),  # strict beats a later number
        ("#### <number>\nThe answer is 42", "42"),  # an echoed template is not an answer
        ("Step 1: 5 + 7 = 12.\nSo the total is 12 apples.", "12"),  # fallback: last number
        ("The answer is 1,234.", "1234"),  # commas, trailing period
        ("#### $1,234,567", "1234567"),
        ("#### -7", "-7"),  # negatives
        ("The temperature fell to -3 degrees.", "-3"),
        ("in 2019-2020 there were 5 cars", "5"),  # a range's dash is not a sign
        ("#### 18.0", "18"),  # "18.0" == "18"
        ("It costs $2.50 each.", "2.5"),  # decimals
        ("####0.75", "0.75"),
        ("I cannot solve this problem.", None),  # no number
        ("", None),
    ],
)
def test_extract_gsm8k_answer(text: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(text) == expected


def test_normalize_number() -> None:
    assert normalize_number("2,125") == "2125"
    assert normalize_number(" $18.00. ") == "18"
    assert normalize_number("-0") == "0"
    assert normalize_number("0.50") == "0.5"


def test_grade_gsm8k() -> None:
    assert grade_gsm8k("Reasoning...\n#### 2125", "2,125")
    assert grade_gsm8k("so she earns 18.0 dollars", "18")
    assert not grade_gsm8k("#### 17", "18")
    assert not grade_gsm8k("no idea", "18")
    with pytest.raises(MarspecError, match="reference"):
        grade_gsm8k("#### 1", None)  # type: ignore[arg-type]


def test_grade_gsm8k_on_the_data_answers() -> None:
    # Each reference worked answer ends with "#### <short_answer>": the grader must accept all of them.
    questions = load_task("gsm8k")
    assert all(grade_gsm8k(q.meta["answer"], q.reference) for q in questions)


# --------------------------------------------------------------------------------------------------------
# HumanEval: extract_code
# --------------------------------------------------------------------------------------------------------

PROMPT = 'from typing import List\n\n\ndef add_all(xs: List[int]) -> int:\n    """Sum of xs."""\n'


def _defines(program: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(program)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(defs) == 1, program
    return defs[0]


def test_extract_code_fenced_full_function_gets_the_prompt_preamble() -> None:
    reply = (
        "Sure! Here is the function:\n\n```python\ndef add_all(xs: List[int]) -> int:\n"
        "    return sum(xs)\n```\n\nExample:\n```python\nprint(add_all([1, 2]))\n```\nHope this helps."
    )
    program = extract_code(reply, PROMPT, "add_all")
    assert program.startswith("from typing import List\n")  # helpers/imports the tests may need
    assert "print(" not in program and "Sure" not in program
    fn = _defines(program, "add_all")
    assert isinstance(fn.body[-1], ast.Return)


def test_extract_code_body_only_is_put_under_the_signature() -> None:
    for reply in (
        "```python\nreturn sum(xs)\n```",
        "    return sum(xs)\n",
        "```\ntotal = sum(xs)\nreturn total```",
    ):
        program = extract_code(reply, PROMPT, "add_all")
        assert program.startswith(PROMPT)
        fn = _defines(program, "add_all")
        assert isinstance(fn.body[-1], ast.Return), program


def test_extract_code_picks_the_block_that_defines_the_function() -> None:
    reply = (
        "```python\nimport math\n```\nand\n```python\ndef helper():\n    return 1\n\n"
        "def add_all(xs):\n    return sum(xs) * helper()\n```"
    )
    program = extract_code(reply, PROMPT, "add_all")
    assert "import math" not in program
    _defines(program, "add_all")
    _defines(program, "helper")


def test_extract_code_unterminated_fence_and_future_import() -> None:
    reply = "```python\nfrom __future__ import annotations\n\ndef add_all(xs):\n    return sum(xs)\n"
    program = extract_code(reply, PROMPT, "add_all")
    assert program.startswith("from __future__ import annotations\n")
    _defines(program, "add_all")


def test_extract_code_unfenced_prose_then_code() -> None:
    reply = "Here is my solution:\ndef add_all(xs):\n    return sum(xs)\n"
    program = extract_code(reply, PROMPT, "add_all")
    assert "Here is" not in program
    _defines(program, "add_all")


def test_extract_code_rejects_a_bad_entry_point() -> None:
    with pytest.raises(MarspecError, match="entry_point"):
        extract_code("x", PROMPT, "not a name")


# --------------------------------------------------------------------------------------------------------
# HumanEval: the sandbox
# --------------------------------------------------------------------------------------------------------

TEST = "def check(candidate):\n    assert candidate() == 1\n"


def _run(body: str, timeout_s: float = 10.0):
    program = "def f():\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"
    return run_humaneval(program, TEST, "f", timeout_s=timeout_s)


@pytest.fixture(scope="module")
def humaneval0():
    return load_task("humaneval", 1)[0].meta


def test_canonical_solution_passes(humaneval0) -> None:
    m = humaneval0
    outcome = run_humaneval(m["prompt"] + m["canonical_solution"], m["test"], m["entry_point"])
    assert outcome.passed and outcome.status == "passed", outcome


def test_body_only_reply_passes_end_to_end(humaneval0) -> None:
    m = humaneval0
    reply = "```python\n" + textwrap.dedent(m["canonical_solution"]) + "```"
    outcome = run_humaneval(extract_code(reply, m["prompt"], m["entry_point"]), m["test"], m["entry_point"])
    assert outcome.passed, outcome


def test_wrong_solution_fails(humaneval0) -> None:
    m = humaneval0
    outcome = run_humaneval(m["prompt"] + "    return False\n", m["test"], m["entry_point"])
    assert not outcome.passed and outcome.status == "failed"
    assert "AssertionError" in outcome.detail and "test.py" in outcome.detail


def test_infinite_loop_times_out() -> None:
    start = time.monotonic()
    outcome = _run("while True:\n    pass", timeout_s=1.5)
    elapsed = time.monotonic() - start
    assert outcome.status == "timeout" and not outcome.passed
    # timing-guard: 40x the sandbox's limit; only a sandbox that never stops the child exceeds it
    assert elapsed < 60


def test_syntax_error_is_an_error() -> None:
    outcome = run_humaneval("def f(:\n    return 1\n", TEST, "f")
    assert outcome.status == "error" and not outcome.passed
    assert "SyntaxError" in outcome.detail


def test_missing_entry_point_is_an_error() -> None:
    outcome = run_humaneval("def g():\n    return 1\n", TEST, "f")
    assert outcome.status == "error" and "does not define f()" in outcome.detail


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_exiting_early_is_not_a_pass(exit_call: str) -> None:
    outcome = _run(exit_call)
    assert not outcome.passed and outcome.status == "failed"


def test_writes_outside_the_work_dir_fail_and_leave_nothing() -> None:
    targets = [
        f"/tmp/marspec_escape_{uuid.uuid4().hex}",
        os.path.expanduser(f"~/marspec_escape_{uuid.uuid4().hex}"),
    ]
    for target in targets:
        outcome = _run(f"with open({target!r}, 'w') as fh:\n    fh.write('x')\nreturn 1")
        assert not outcome.passed and outcome.status == "failed", outcome
        assert "PermissionError" in outcome.detail
        assert not os.path.exists(target)
    # Inside its own directory the program may write.
    assert _run("with open('scratch.txt', 'w') as fh:\n    fh.write('x')\nreturn 1").passed


def test_writes_that_bypass_the_python_guard_leave_nothing() -> None:
    # ctypes calls open(2) directly; only the OS-level isolation stops these.
    report = sandbox_report()
    if not report.get("mount_namespace"):
        pytest.skip("no mount namespace here (needs root with CAP_SYS_ADMIN)")
    targets = [
        f"/tmp/marspec_escape_{uuid.uuid4().hex}",
        os.path.expanduser(f"~/marspec_escape_{uuid.uuid4().hex}"),
    ]
    for target in targets:
        _run(f"import ctypes\nctypes.CDLL(None).open({target.encode()!r}, 0o1101, 0o644)\nreturn 1")
        assert not os.path.exists(target)


def test_network_is_blocked() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        outcome = _run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nreturn 1")
        assert not outcome.passed and "network" in outcome.detail, outcome
        outcome = _run(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nreturn 1")
        assert not outcome.passed and "network" in outcome.detail, outcome
        if sandbox_report().get("network_namespace"):
            # A fresh _socket module escapes the Python guard; the network namespace still has no route.
            bypass = (
                "import sys\nsys.modules.pop('socket'); sys.modules.pop('_socket')\nimport _socket\n"
                f"s = _socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nreturn 1"
            )
            assert not _run(bypass).passed
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_memory_limit() -> None:
    outcome = _run("block = bytearray(4 << 30)\nreturn 1")
    assert not outcome.passed and outcome.status == "failed"
    assert "MemoryError" in outcome.detail


def test_processes_cannot_be_started() -> None:
    outcome = _run("import subprocess\nreturn int(subprocess.check_output(['echo', '1']))")
    assert not outcome.passed and "processes" in outcome.detail
    if sandbox_report().get("user_switched"):  # RLIMIT_NPROC=1 for the sandbox user
        outcome = _run("import ctypes\nassert ctypes.CDLL(None).fork() == -1\nreturn 1")
        assert outcome.passed, outcome


def test_sandbox_report_as_root() -> None:
    report = sandbox_report()
    assert report["outcome"] == "passed", report
    assert report["no_new_privs"] and report["python_guard"]
    assert report["rlimits"]["AS"] == 1 << 30 and report["rlimits"]["CORE"] == 0
    if os.geteuid() != 0:
        pytest.skip("the namespaces and the user switch need root")
    assert report["user_switched"] and report["uid"] != 0
    assert report["network_namespace"] and report["mount_namespace"]
    assert "/tmp" in report["hidden_paths"]
    assert report["rlimits"]["NPROC"] == 1


def test_bad_arguments() -> None:
    with pytest.raises(MarspecError, match="timeout_s"):
        run_humaneval("def f():\n    return 1\n", TEST, "f", timeout_s=0)
    with pytest.raises(MarspecError, match="entry_point"):
        run_humaneval("def f():\n    return 1\n", TEST, "f()")


# --------------------------------------------------------------------------------------------------------
# MT-Bench agreement
# --------------------------------------------------------------------------------------------------------


def test_chrf() -> None:
    text = "The quick brown fox jumps over the lazy dog."
    assert chrf(text, text) == 100.0
    assert chrf("", "") == 100.0
    different = chrf("The quick brown fox jumped over a sleeping cat.", text)
    assert 0.0 < different < 100.0
    assert chrf("zzzz", text) < different
    with pytest.raises(MarspecError):
        chrf([1, 2], text)  # type: ignore[arg-type]


def test_exact_match() -> None:
    assert exact_match("a b", "a b")
    assert not exact_match("a b", "a b ")
    assert not exact_match("a", "A")
