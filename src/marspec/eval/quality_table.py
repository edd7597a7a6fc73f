"""The quality/speed table docs/results.md opens with, from finished benchmark runs.

One row per (run, method): the task and temperature, questions x samples, speedup over the run's
speed baseline (plain, on the questions it ran on when it was limited; else strict), tau, the task
score and recovery with their 95% intervals, and the reference recovery is measured against. Runs still
in progress are refused: a table never mixes a partial run into whole ones.

    python -m marspec.eval.quality_table docs/results/greedy-humaneval-100 docs/results/greedy-gsm8k-50 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from marspec.errors import MarspecError
from marspec.eval.rundir import whole_run

HEADER = (
    "| task | temperature | method | questions x samples | speedup | tau | score [95% CI] "
    "| recovery [95% CI] |\n|---|---|---|---|---|---|---|---|"
)


def rows(run: Path) -> list[str]:
    config, summary = whole_run(run)
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
    try:
        sys.exit(main())
    except MarspecError as exc:
        sys.exit(f"error: {exc}")
