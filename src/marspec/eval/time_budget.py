"""Where a bench run's wall time went, and what a cheaper draft would buy.

For each of marspec's own methods in a `marspec bench` directory, splits the wall time into prefill
(measured), verification forwards and draft forwards (the run's recorded forwards at the run's profiled
costs, profile.json, or the measured draft time where the records hold it) and the loop's own overhead
(measured); the rest is the gap between profile and run. Then it prices two what-ifs against plain in
the same run: drafting at half its cost, and free drafting (the ceiling any cheaper drafter can reach at
this tau). Speedups here are aggregate (total tokens / total time), not the per-question mean of the
bench summary, so they differ from it by a few percent.

    python -m marspec.eval.time_budget runs/humaneval-30-prepack runs/mtbench-30-prepack
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from marspec.errors import MarspecError
from marspec.eval.method_names import PLAIN
from marspec.eval.rundir import load_costs, load_records
from marspec.profile import verify_seconds


def budget(run: Path) -> dict[str, dict[str, float]]:
    """Seconds by component, per method that records its steps (a peer's loop does not), over the
    questions plain decoded (a run with --plain-limit times plain on its first questions only, and the
    ratios must compare the same questions)."""
    costs = load_costs(run)
    if costs is None:
        raise MarspecError(f"{run} has no profile.json: run `marspec bench` to the end once")
    records = load_records(run)
    with_plain = {qid for qid, method, _ in records if method == PLAIN}
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (qid, method, _), record in records.items():
        if qid not in with_plain:
            continue
        for turn in record["turns"]:
            if turn.get("verify_sizes") is None:
                break
            t = totals[method]
            t["wall"] += turn["wall_s"]
            t["tokens"] += turn["new_tokens"]
            t["prefill"] += turn["prefill_s"]
            t["overhead"] += turn["overhead_s"]
            t["verify"] += verify_seconds(turn["verify_sizes"], costs)
            measured = turn.get("draft_forward_s")
            t["draft"] += measured if measured is not None else turn["draft_forwards"] * costs.draft_s(1)
            t["draft_forwards"] += turn["draft_forwards"]
    return totals


def report(run: Path) -> str:
    totals = budget(run)
    if "plain" not in totals:
        raise MarspecError(f"{run} has no plain method to compare with")
    plain_s_per_token = totals["plain"]["wall"] / totals["plain"]["tokens"]
    lines = [
        f"## {run}",
        "",
        "| method | ms/token | speedup | prefill | verification | drafting | ms/draft forward | overhead "
        "| rest | drafting at half cost | free drafting |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, t in totals.items():
        wall, tokens = t["wall"], t["tokens"]
        rest = wall - t["prefill"] - t["verify"] - t["draft"] - t["overhead"]

        def speedup(seconds: float, tokens: float = tokens) -> str:
            return f"{plain_s_per_token * tokens / seconds:.2f}x"

        def shares(*parts: float, wall: float = wall) -> str:
            return " | ".join(f"{seconds / wall:.1%}" for seconds in parts)

        # A chain draft forward proposes one token; a tree's proposes a level of nodes.
        per_draft = f"{1000 * t['draft'] / t['draft_forwards']:.1f}" if t["draft_forwards"] else "—"
        what_if = "— | —"
        if t["draft"]:
            what_if = f"{speedup(wall - t['draft'] / 2)} | {speedup(wall - t['draft'])}"
        lines.append(
            f"| {method} | {1000 * wall / tokens:.1f} | {speedup(wall)} | "
            f"{shares(t['prefill'], t['verify'], t['draft'])} | {per_draft} | "
            f"{shares(t['overhead'], rest)} | {what_if} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="directories written by `marspec bench`")
    for run in parser.parse_args().runs:
        print(report(run))


if __name__ == "__main__":
    try:
        main()
    except MarspecError as exc:
        sys.exit(f"error: {exc}")
