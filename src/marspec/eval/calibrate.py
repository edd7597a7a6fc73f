"""``marspec calibrate``: measure MARS settings against strict verification and store the choice.

Each task of the calibration slice is one resumable benchmark run (``DIR/TASK``) of ``strict`` and the
candidate settings, interleaved question by question. Strict is the quality reference (it equals plain
decoding, token for token when greedy and in distribution when sampling) and the speed reference, so
plain decoding, the most expensive method, is not needed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from marspec.calibration import Candidate, Choice, choose
from marspec.eval.methods import Method

# Candidate settings when the user names none: the paper's logit ratio at and above its 0.9, and the
# scale-aware probability ratio p2/p1 over the range where near-ties on the default pair fall.
DEFAULT_CANDIDATES = (
    "mars-ratio@0.9",
    "mars-ratio@0.94",
    "mars-ratio@0.98",
    "mars-prob@0.25",
    "mars-prob@0.5",
    "mars-prob@0.75",
)


def candidates_of(summary: dict[str, Any], methods: Sequence[Method], task: str) -> list[Candidate]:
    """The candidate rows of one task's benchmark summary (strict is its reference for both speed and
    quality)."""
    strict = summary["methods"]["strict"]
    rows = []
    for m in methods:
        if m.kind != "mars":
            continue
        metrics = summary["methods"][m.name]
        ci = metrics.get("recovery_ci") or [None, None]
        tau, strict_tau = metrics["tau"], strict["tau"]
        rows.append(
            Candidate(
                method=m.name,
                margin=m.margin or summary["config"]["margin"],
                theta=float(m.theta if m.theta is not None else summary["config"]["theta"]),
                task=task,
                speedup_vs_strict=metrics["speedup"],
                tau_vs_strict=tau / strict_tau if tau and strict_tau else None,
                recovery=metrics["recovery"],
                recovery_lo=ci[0],
                recovery_hi=ci[1],
                questions=summary["questions"],
            )
        )
    return rows


def make_choice(
    rows: list[Candidate],
    budget: float,
    temperature: float,
    tasks: dict[str, list[str]],
    drafting: dict[str, Any],
) -> Choice:
    margin, theta, met, reason = choose(rows, budget)
    return Choice(
        margin=margin,
        theta=theta,
        budget=budget,
        met_budget=met,
        reason=reason,
        temperature=temperature,
        tasks=tasks,
        table=rows,
        drafting=drafting,
    )
