"""No test may depend on how fast the machine is.

A busy machine makes every measured duration longer and noisier, so an assertion that orders a measured
duration or rate (``a["prefill_s"] < b["prefill_s"]``, ``speedup > 1.2``, ``tok_s >= 5``) turns red for
reasons that have nothing to do with the code. Such an assertion has landed twice; this check keeps the
next one from landing. Speed goals live in benchmarks (benchmarks/, docs/results.md), never in tests.

What is flagged: an ``assert`` whose expression contains an ordering comparison (<, <=, >, >=) with a
timing-like operand (a name, attribute or string key that names a duration or a rate, or a clock call)
on one side and anything but the literal 0 on the other. ``wall_s > 0`` (a duration was measured at all)
and equalities are allowed. An ordering that no machine's speed can break (a part of a sum against the
sum, a minimum against a median, a deadline tens of times longer than the work it waits for) carries
``# timing-guard: <why no speed can break it>`` on one of its lines or the comment line above it; the
reason is required.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("tests", "tests_vllm")

# Words that name a measured duration or a rate: the project's record keys end in _s (wall_s, prefill_s,
# target_forward_s) or _ms; rates are tok_s, tokens_per_s, speedup, throughput.
TIMING_WORD = re.compile(
    r"(_s|_ms|_us|_ns|seconds|secs|elapsed|duration|latency|speed|speedup|throughput|tok_s|tps"
    r"|tokens_per_s|per_second|wall|perf_counter|monotonic)$|^(time|seconds|elapsed|duration|t0|t1)$",
    re.IGNORECASE,
)
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "process_time"}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
EXEMPT = re.compile(r"#\s*timing-guard:\s*\S.{9,}")  # a reason of ten characters or more


def _words(node: ast.AST) -> list[str]:
    """The names, attributes, string subscripts and called clocks an expression mentions."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.append(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.append(sub.attr)
        elif isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant):
            if isinstance(sub.slice.value, str):
                found.append(sub.slice.value)
        elif isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in CLOCKS:
                found.append("perf_counter")
    return found


def _is_timing(node: ast.AST) -> bool:
    return any(TIMING_WORD.search(word) for word in _words(node))


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _orders_timing(comp: ast.Compare) -> bool:
    operands = [comp.left, *comp.comparators]
    return any(
        isinstance(op, ORDERING)
        and ((_is_timing(left) and not _is_zero(right)) or (_is_timing(right) and not _is_zero(left)))
        for op, left, right in zip(comp.ops, operands[:-1], operands[1:], strict=True)
    )


def timing_assertions(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: text`` for each assertion in ``source`` that orders a measured duration or rate."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Assert):
            continue
        marked = lines[node.lineno - 1 : node.end_lineno]
        above = lines[node.lineno - 2] if node.lineno > 1 else ""
        if above.lstrip().startswith("#"):
            marked.append(above)
        if any(EXEMPT.search(line) for line in marked):
            continue
        if any(isinstance(sub, ast.Compare) and _orders_timing(sub) for sub in ast.walk(node.test)):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node.test)}")
    return found


def test_no_test_asserts_a_duration_or_a_speed():
    offenders = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            offenders += timing_assertions(path.read_text(), str(path.relative_to(ROOT)))
    assert not offenders, (
        "these assertions order measured durations or rates, so a busy machine turns them red; assert "
        "what the code guarantees instead (counts, tokens, outputs):\n" + "\n".join(offenders)
    )


def test_the_guard_catches_planted_timing_comparisons():
    planted = {
        'assert reused[1]["prefill_s"] < fresh[1]["prefill_s"]': True,
        "assert stats.wall_s <= 2.0": True,
        "assert summary['speedup'] > 1.1": True,
        "assert tok_s >= 5": True,
        "assert time.perf_counter() - start < 1.0": True,
        "assert 0.5 < elapsed": True,
        "assert x.target_forward_s > y.target_forward_s * 0.9": True,
        "assert stats.wall_s > 0": False,
        "assert stats.prefill_s >= 0 and stats.tau > 1.0": False,
        'assert a["prefill_s"] == b["prefill_s"]': False,
        "assert stats.tau > 1.0": False,
        "assert len(tokens) <= 16": False,
        "assert forwards <= stats.wall_s  # timing-guard: the forwards are parts of the wall time": False,
        "assert stats.wall_s < 9  # timing-guard:": True,
        "# timing-guard: the forwards are parts of the wall time\nassert forwards <= stats.wall_s": False,
        "x = 1  # timing-guard: the forwards are parts of the wall time\nassert wall_s < 2": True,
    }
    for line, flagged in planted.items():
        assert bool(timing_assertions(line)) is flagged, line
