"""The quality/speed table docs/results.md opens with, from finished benchmark runs.

One row per (run, method): the task and temperature, questions x samples, speedup over the run's
speed baseline (plain, on the questions it ran on when it was limited; else strict), tau, the task
score and recovery with their 95% intervals, and the reference recovery is measured against. Runs still
in progress are refused: a table never mixes a partial run into whole ones.

    python benchmarks/quality_table.py docs/results/greedy-humaneval-100 docs/results/greedy-gsm8k-50 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from marspec.errors import MarspecError
from marspec.eval.bench import BenchConfig, load_records, read_run, runs_on

HEADER = (
    "| task | temperature | method | questions x samples | speedup | tau | score [95% CI] "
    "| recovery [95% CI] |\n|---|---|---|---|---|---|---|---|"
)


def is_whole(run: Path, config: BenchConfig, summary: dict) -> bool:
    """Whether every planned decode of the run's methods on its questions is recorded."""
    records = load_records(run)
    # Summaries written before they listed their questions: the questions the records hold.
    qids = summary.get("qids") or list(dict.fromkeys(q for q, _, _ in records))
    if len(qids) != summary["questions"]:
        return False
    return all(
        (qid, method, sample) in records
        for index, qid in enumerate(qids)
        for method in summary["methods"]
        if runs_on(method, index, config)
        for sample in range(config.samples)
    )


def rows(run: Path) -> list[str]:
    try:
        raw, summary = read_run(run)
    except MarspecError as exc:
        raise SystemExit(f"{run} is not a whole run: {exc}") from None
    config = BenchConfig(**{**raw, "methods": tuple(raw["methods"])})
    if not is_whole(run, config, summary):
        raise SystemExit(f"{run} is not a whole run: finish it before tabulating it")
    temp = config.temperature
    ref = summary["quality_reference"]
    out = []
    for name, m in summary["methods"].items():
        ci = m.get("score_ci") or [None, None]
        rci = m.get("recovery_ci") or [None, None]
        speed = "—" if m.get("speedup") is None else f"{m['speedup']:.2f}x vs {summary['baseline']}"
        if m.get("speed_questions") not in (None, summary["questions"]):
            speed += f" (on {m['speed_questions']} q)"
        score = "—" if m.get("score") is None else f"{m['score']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        recovery = "—"
        if m.get("recovery") is not None:
            recovery = f"{m['recovery']:.1%} [{rci[0]:.1%}, {rci[1]:.1%}] vs {ref}"
        tau = "—" if m.get("tau") is None else f"{m['tau']:.2f}"
        out.append(
            f"| {config.task} | {temp:g} | {name} | {m.get('questions', summary['questions'])} x "
            f"{summary['samples']} | {speed} | {tau} | {score} | {recovery} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    lines = [HEADER]
    for run in args.runs:
        lines += rows(run)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
