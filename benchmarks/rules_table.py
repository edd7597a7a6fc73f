"""Lossy rules compared on one task: speed at matched recovery, from whole runs on the same questions.

Each run's speed is against its own strict (greedy strict equals plain, so strict is both the quality
reference and the speed baseline of a sweep or a rivals run). A method in several runs is taken from
the first run listed, so list the run that has strict and the rivals side by side first:

    python benchmarks/rules_table.py docs/results/rivals-greedy-humaneval-30 \
        docs/results/sweep-greedy-humaneval-30

Per method: the summary's speedup (Spec-Bench mean of per-question tokens/s ratios), the median of the
per-question tokens/s ratio against strict's decode of the same question (the two ran back to back),
tau and its ratio to strict's, answers kept, lost and won against strict, recovery with its 95%
interval, and relaxed accepts per 1,000 emitted tokens. Then the fastest rule at recovery >= 100%, at
>= 95% (point estimates; the intervals say how far 30 questions can be trusted) and among those that
lost no answer strict had.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from marspec.errors import MarspecError
from marspec.eval.bench import load_records, whole_run
from marspec.eval.contention import contended

HEADER = (
    "| method (run) | speedup vs strict | paired median | tau (vs strict) | passed | lost / won "
    "| recovery [95% CI] | relaxed per 1k tokens |\n|---|---|---|---|---|---|---|---|"
)


def _rate(record: dict) -> float:
    turns = record["turns"]
    return sum(t["new_tokens"] for t in turns) / sum(t["wall_s"] for t in turns)


Point = tuple[str, float, float, int]  # method, speedup vs strict, recovery, answers lost


def rows(runs: list[Path]) -> tuple[list[str], list[Point], int]:
    """Table rows, a point for every lossy method, and how many of the decodes used were timed while
    other processes loaded the machine (their speed is suspect: ``marspec bench --redo-contended``)."""
    lines, points, seen, busy = [], [], set(), 0
    for run in runs:
        try:
            _, summary = whole_run(run)
        except MarspecError as exc:
            raise SystemExit(str(exc)) from None
        if summary["baseline"] != "strict" or summary.get("quality_reference") != "strict":
            raise SystemExit(f"{run}: speed and quality must both be against strict (a run without plain)")
        records = load_records(run)
        by_method: dict[str, dict[str, dict]] = {}
        for (qid, method, _), rec in records.items():
            by_method.setdefault(method, {})[qid] = rec
        strict = by_method["strict"]
        strict_tau = summary["methods"]["strict"]["tau"]
        for name, m in summary["methods"].items():
            if name in seen:
                continue
            seen.add(name)
            mine = by_method[name]
            busy += sum(contended(rec) for rec in mine.values())
            paired = statistics.median(_rate(mine[q]) / _rate(strict[q]) for q in mine)
            lost = sum(strict[q]["score"] > mine[q]["score"] for q in mine)
            won = sum(strict[q]["score"] < mine[q]["score"] for q in mine)
            passed = sum(mine[q]["score"] for q in mine)
            tokens = sum(t["new_tokens"] for rec in mine.values() for t in rec["turns"])
            relaxed = sum(t["accepted_relaxed"] for rec in mine.values() for t in rec["turns"])
            lo, hi = m["recovery_ci"]
            lines.append(
                f"| {name} ({run.name}) | {m['speedup']:.2f}x | {paired:.2f}x | {m['tau']:.2f} "
                f"({m['tau'] / strict_tau:.2f}x) | {passed:g}/{len(mine)} | {lost} / {won} "
                f"| {m['recovery']:.1%} [{lo:.1%}, {hi:.1%}] | {1000 * relaxed / tokens:.1f} |"
            )
            if name != "strict":
                points.append((name, m["speedup"], m["recovery"], lost))
    return lines, points, busy


def fastest(points: list[Point], label: str, qualifies: Callable[[Point], bool]) -> str:
    qualifying = [p for p in points if qualifies(p)]
    if not qualifying:
        return f"no lossy setting {label}"
    name, speed, recovery, lost = max(qualifying, key=lambda p: p[1])
    return f"fastest {label}: {name} ({speed:.2f}x strict, recovery {recovery:.1%}, {lost} lost)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    lines, points, busy = rows(args.runs)
    print("\n".join([HEADER, *lines]))
    print()
    if busy:
        print(f"- **{busy} decodes were timed on a busy machine**: speeds are suspect until a rerun of")
        print("  `marspec bench ... --redo-contended` decodes them again")
    # Recovery is net: on a task where answers churn both ways, 100% can hide losses, hence the third.
    print(f"- {fastest(points, 'at recovery >= 100%', lambda p: p[2] >= 1 - 1e-9)}")
    print(f"- {fastest(points, 'at recovery >= 95%', lambda p: p[2] >= 0.95 - 1e-9)}")
    print(f"- {fastest(points, 'that lost no answer', lambda p: p[3] == 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
