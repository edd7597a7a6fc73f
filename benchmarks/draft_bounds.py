r"""Where a pair's speculative speed is bounded on this machine: its draft's step or its verification.

Reads what the draft-length choice measured for each pair on this processor (the model cache's
``draft-length`` records, written the first time a pair loads: ``marspec demo`` does) and asks the same
cost model (:mod:`marspec.draft_length.cost_model`) what speed it expects, as a ratio to the target's own
one-token step, under the measured costs and under costs made ideal one part at a time:

- ``measured``: the choice the pair decodes with (:func:`marspec.draft_length.decide`);
- ``free verification``: verifying k + 1 rows costs one step (what cheaper many-row kernels could win
  at most);
- ``draft at half cost`` / ``free draft``: a draft step half as dear, or free (what a cheaper drafter
  could win; free is the ceiling the acceptance alone sets).

Each bound keeps the pair's measured acceptance on the calibration text and lets k (up to the
verifications measured) and the stop be chosen anew. Nothing is timed here: it reads stored numbers,
so run it after a quiet measurement (``MARSPEC_DRAFT_COSTS=again marspec demo``).

    python benchmarks/draft_bounds.py --out docs/results/draft-bounds-2026-12-07.json
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from _common import machine, script_parser, write_json  # this folder's shared helpers

from marspec.backends import kernels
from marspec.backends.kernels.paths import runnable_paths
from marspec.draft_length import decide
from marspec.draft_length.cost_model import STOPS, Acceptance, Costs, Prediction, choose
from marspec.draft_length.measure import Measured
from marspec.draft_length.store import stored_on
from marspec.eval.cpu import cpu_name


def bounds(measured: Measured) -> dict[str, Prediction]:
    """The cost model's best setting under the measured costs and under each ideal one."""
    costs = decide(measured).costs  # the measured costs as the choice reads them (rising with rows)
    acceptances = [Acceptance.measured(s, measured.confidences, measured.accepted) for s in STOPS]
    step = costs.verify(1)
    ideal = {
        "measured": costs,
        "free verification": Costs({rows: step for rows in costs.target}, costs.draft),
        "draft at half cost": replace(costs, draft=costs.draft / 2),
        "free draft": replace(costs, draft=0.0),
    }
    return {name: choose(c, acceptances) for name, c in ideal.items()}


def today_builds() -> set[str]:
    """The kernels a pair's record names when measured on a build of today's sources (every path this CPU
    runs); records of older builds measured other kernels."""
    return {f"{path.name} {kernels.build_id(path)}" for path in runnable_paths()}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--all", action="store_true", help="also the records of older kernel builds")
    parser.add_argument("--out")
    args = parser.parse_args()
    cpu = cpu_name()
    builds = today_builds()
    found = [(key, m) for key, m in stored_on(cpu) if args.all or key.kernels in builds]
    if not found:
        raise SystemExit(
            f"nothing measured on this CPU ({cpu}) with today's kernels yet: load a pair with a draft model "
            "first (marspec demo; MARSPEC_CPU_PATH=avx2 marspec demo for that path)"
        )
    results: list[dict[str, Any]] = []
    for key, measured in found:
        step = decide(measured).costs.verify(1)
        print(
            f"{key.target} + {key.draft}, {key.threads} threads, {key.kernels}: "
            f"target step {1000 * step:.1f} ms, draft step {1000 * measured.draft_s:.1f} ms"
        )
        pair: dict[str, Any] = {"key": asdict(key), "step_s": step, "draft_s": measured.draft_s, "bounds": {}}
        for name, best in bounds(measured).items():
            ratio = best.tokens_per_s * step
            print(
                f"  {name:20s} k={best.k:<2} stop {best.stop:<4g} "
                f"{best.tokens_per_step:.2f} tokens/step  {ratio:.2f}x plain"
            )
            pair["bounds"][name] = {**asdict(best), "x_plain": ratio}
        results.append(pair)
    if args.out:
        write_json(args.out, {"machine": machine(), "pairs": results})


if __name__ == "__main__":
    main()
