"""Lossy rules compared on one task: speed at matched recovery, from whole runs on the same questions.

Each run's speed is against its own strict (greedy strict equals plain, so strict is both the quality
reference and the speed baseline of a sweep or a rivals run). A method in several runs is taken from
the first run listed, so list the run that has strict and the rivals side by side first:

    python -m marspec.eval.rules_table docs/results/rivals-greedy-humaneval-30 \
        docs/results/sweep-greedy-humaneval-30

Per method: the summary's speedup (Spec-Bench mean of per-question tokens/s ratios), the median of the
per-question tokens/s ratio against strict's decode of the same question on the same CPU model (the two
ran back to back unless strict was decoded again elsewhere; a question without one is left out),
tau and its ratio to strict's, answers kept, lost and won against strict (a sampled question scores the
mean over its samples, as the summary scores it), recovery with its 95% interval, the exchange test's
p-value against strict (:func:`marspec.eval.intervals.exchange_p_value`: how often samples reassigned at
random between the two, question by question, differ as much; under sampling a lossless rule's p is
uniform, so a small one alone says little when several rules are compared), and relaxed accepts per
1,000 emitted tokens. Then the fastest rule at recovery >= 100%, at >= 95% (point estimates; the
intervals say how far 30 questions can be trusted) and among those that lost no answer strict had.

With --pooled, the runs are of different tasks (each with strict and the rivals side by side) and the
table pools their questions, for the methods every run has: answers passed, lost and won against
strict, and the difference in answers per 100 questions with a paired bootstrap interval (the pooled
questions resampled as one set), beside each run's own speedup:

    python -m marspec.eval.rules_table --pooled docs/results/rivals-greedy-humaneval-30 \
        docs/results/rivals-greedy-gsm8k-30
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from marspec.errors import MarspecError
from marspec.eval.contention import contended
from marspec.eval.intervals import difference_interval, exchange_p_value
from marspec.eval.method_names import REFERENCE
from marspec.eval.rundir import load_records
from marspec.eval.summary import question_score, summary_of

HEADER = (
    "| method (run) | speedup vs strict | paired median | tau (vs strict) | passed | lost / won "
    "| recovery [95% CI] | exchange p | relaxed per 1k tokens |\n|---|---|---|---|---|---|---|---|---|"
)


Point = tuple[str, float, float, int]  # method, speedup vs strict, recovery, answers lost


def _speed(value: float | None, apart: int = 0) -> str:
    """A speed ratio; marked † where some of its questions were not timed back to back with strict."""
    return "—" if value is None else f"{value:.2f}x{'†' if apart else ''}"


def _records_by_method(run: Path) -> dict[str, dict[str, list[dict]]]:
    """method -> question id -> its newest record of each sample (one sample per question when greedy)."""
    by_method: dict[str, dict[str, list[dict]]] = {}
    for (qid, method, _), rec in load_records(run).items():
        by_method.setdefault(method, {}).setdefault(qid, []).append(rec)
    return by_method


def rows(runs: list[Path]) -> tuple[list[str], list[Point], int]:
    """Table rows, a point for every lossy method, and how many of the decodes used were timed while
    other processes loaded the machine (their speed is suspect: ``marspec bench --redo-contended``)."""
    lines, points, seen, busy = [], [], set(), 0
    for run in runs:
        summary = summary_of(run)  # this version's metrics, whatever version wrote the summary file
        if summary["baseline"] != REFERENCE or summary.get("quality_reference") != REFERENCE:
            raise MarspecError(f"{run}: speed and quality must both be against strict (a run without plain)")
        by_method = _records_by_method(run)
        strict = by_method["strict"]
        strict_tau = summary["methods"]["strict"]["tau"]
        for name, m in summary["methods"].items():
            if name in seen:
                continue
            seen.add(name)
            mine = by_method[name]
            decodes = [rec for recs in mine.values() for rec in recs]
            busy += sum(contended(rec) for rec in decodes)
            lost = sum(question_score(strict[q]) > question_score(mine[q]) for q in mine)
            won = sum(question_score(strict[q]) < question_score(mine[q]) for q in mine)
            passed = sum(question_score(mine[q]) for q in mine)
            tokens = sum(t["new_tokens"] for rec in decodes for t in rec["turns"])
            relaxed = sum(t["accepted_relaxed"] for rec in decodes for t in rec["turns"])
            lo, hi = m["recovery_ci"]
            questions = sorted(mine)
            p = exchange_p_value(_sample_scores(mine, questions), _sample_scores(strict, questions))
            lines.append(
                f"| {name} ({run.name}) | {_speed(m['speedup'], m['speed_apart'])} "
                f"| {_speed(m['speedup_median'], m['speed_apart'])} "
                f"| {m['tau']:.2f} "
                f"({m['tau'] / strict_tau:.2f}x) | {passed:.4g}/{len(mine)} | {lost} / {won} "
                f"| {m['recovery']:.1%} [{lo:.1%}, {hi:.1%}] | {p:.2g} | {1000 * relaxed / tokens:.1f} |"
            )
            if name != REFERENCE and m["speedup"] is not None:
                marked = f"{name}†" if m["speed_apart"] else name  # see the footnote main prints
                points.append((marked, m["speedup"], m["recovery"], lost))
    return lines, points, busy


def _sample_scores(by_q: dict[str, list[dict]], questions: list[str]) -> list[list[float]]:
    """Each of ``questions``' sample scores, in that order."""
    return [[float(rec["score"]) for rec in by_q[q]] for q in questions]


def pooled(runs: list[Path]) -> list[str]:
    """One row per method that every run has: its questions pooled across the runs (see the module doc)."""
    per_run = []
    for run in runs:
        summary = summary_of(run)
        by_method = _records_by_method(run)
        scores = {m: {q: question_score(recs) for q, recs in by_q.items()} for m, by_q in by_method.items()}
        per_run.append((run, summary, scores))
    shared = [m for m in per_run[0][1]["methods"] if all(m in s["methods"] for _, s, _ in per_run)]
    if "strict" not in shared:
        raise MarspecError("--pooled needs strict in every run (it is the quality reference)")
    names = " | ".join(f"speedup ({run.name})" for run, _, _ in per_run)
    lines = [
        f"| method | {names} | passed | lost / won | difference per 100 questions [95% CI] |",
        "|---|" + "---|" * (len(per_run) + 3),
    ]
    for name in shared:
        mine, reference = [], []
        for _, _, by_method in per_run:
            strict = by_method["strict"]
            questions = sorted(by_method[name])
            mine += [by_method[name][q] for q in questions]
            reference += [strict[q] for q in questions]
        lost = sum(r > m for m, r in zip(mine, reference, strict=True))
        won = sum(r < m for m, r in zip(mine, reference, strict=True))
        diff = difference_interval(mine, reference)
        speeds = " | ".join(_speed(s["methods"][name]["speedup"]) for _, s, _ in per_run)
        lines.append(
            f"| {name} | {speeds} | {sum(mine):.4g}/{len(mine)} | {lost} / {won} "
            f"| {100 * diff.value:+.1f} [{100 * diff.lo:+.1f}, {100 * diff.hi:+.1f}] |"
        )
    return lines


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
    parser.add_argument(
        "--pooled", action="store_true", help="runs of different tasks: their questions pooled per method"
    )
    args = parser.parse_args(argv)
    if args.pooled:
        print("\n".join(pooled(args.runs)))
        return 0
    lines, points, busy = rows(args.runs)
    print("\n".join([HEADER, *lines]))
    print()
    if busy:
        print(f"- **{busy} decodes were timed on a busy machine**: speeds are suspect until a rerun of")
        print("  `marspec bench ... --redo-contended` decodes them again")
    if any("†" in line for line in lines):
        print("- **†: timed apart from strict** (another sitting or CPU) on some questions: such a speed")
        print("  carries the machine's drift (a few %) until `marspec bench ... --redo-apart` redoes them")
    for run in args.runs:
        cpus = summary_of(run)["cpus"]
        if len(cpus) > 1:
            print(f"- **{run.name} decoded on {len(cpus)} processor models** ({cpus}): each speed ratio")
            print("  pairs decodes on one CPU; '—' where strict never ran on the method's CPU")
    # Recovery is net: on a task where answers churn both ways, 100% can hide losses, hence the third.
    print(f"- {fastest(points, 'at recovery >= 100%', lambda p: p[2] >= 1 - 1e-9)}")
    print(f"- {fastest(points, 'at recovery >= 95%', lambda p: p[2] >= 0.95 - 1e-9)}")
    print(f"- {fastest(points, 'that lost no answer', lambda p: p[3] == 0)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MarspecError as exc:
        sys.exit(f"error: {exc}")
