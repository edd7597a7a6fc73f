"""The fixed-shape path (``graphs="on"``) decodes eager's tokens; on CUDA through captured graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marspec.api import Decoder

from marspec.selftest.equality import PROMPTS, TREE, compare_runs, generate_greedy
from marspec.selftest.report import Check

SETTINGS = (
    ("plain", {"rule": "plain"}),
    ("strict chain", {"rule": "strict"}),
    (f"strict tree {TREE}", {"rule": "strict", "tree": TREE}),
    ("mars 0.3", {"rule": "mars", "theta": 0.3, "margin": "prob_ratio"}),
)


def fixed_equals_eager(eager: Decoder, fixed: Decoder) -> Check:
    """Greedy plain, strict (chain and tree) and a relaxing MARS decode the same tokens on the fixed-shape
    path as on the eager one; where the fixed path captures CUDA graphs, every capture's replay equalled
    its uncaptured forward and the decodes ran on replays."""
    name = "fixed shapes == eager" + (" (CUDA graphs)" if fixed.captured else "")
    runs = []
    for i, prompt in enumerate(PROMPTS):
        for label, options in SETTINGS:
            runs.append(
                (
                    f"prompt {i + 1}, {label}",
                    generate_greedy(eager, prompt, **options),
                    generate_greedy(fixed, prompt, **options),
                )
            )
    check = compare_runs(name, runs)
    if not check.passed or not fixed.captured:
        return check
    records = [r for lm in _lms(fixed) if lm.graphs is not None for r in lm.graphs.records]
    failed = [r for r in records if not r.passed]
    if failed or not records:
        what = f"replay != eager for shapes {[r.key for r in failed]}" if failed else "nothing was captured"
        return Check(name, False, f"{check.detail}; {what}")
    return Check(
        name, True, f"{check.detail}; {len(records)} shapes captured, each replay == eager bit for bit"
    )


def _lms(decoder: Decoder) -> list:
    drafter = decoder.drafter
    return [decoder.target] + ([drafter.draft_model] if drafter is not None and drafter.draft_model else [])
