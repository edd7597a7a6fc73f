"""``theta="auto"``: the MARS setting a calibration measured for one (target, draft) pair.

``marspec calibrate`` benchmarks candidate (margin, theta) settings against strict verification on a
calibration slice of the tasks and keeps the fastest one whose recovery's 95% lower bound meets the
user's budget on every task (:func:`choose`). The choice is stored per pair, separately for greedy
decoding and for sampling, as JSON in the model cache together with the table it was chosen from and
the questions it was measured on (:func:`save_choice`); ``theta="auto"`` reads it back
(:func:`load_choice`).
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from marspec.errors import MarspecError
from marspec.models import cache_dir
from marspec.rules import Rule

Regime = Literal["greedy", "sampling"]
FILE_VERSION = 1

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


def regime_of(temperature: float) -> Regime:
    return "greedy" if temperature == 0 else "sampling"


@dataclass(frozen=True)
class Candidate:
    """One setting measured on one task: speed and quality relative to strict verification."""

    method: str  # the bench method name, e.g. "mars-prob@0.5"
    margin: str
    theta: float
    task: str
    speedup_vs_strict: float | None
    tau_vs_strict: float | None
    recovery: float | None
    recovery_lo: float | None
    recovery_hi: float | None
    questions: int


@dataclass(frozen=True)
class Choice:
    """The calibrated setting for one pair and regime, and what it rests on."""

    margin: str
    theta: float
    budget: float
    met_budget: bool  # False: no candidate met it, and the choice is theta 1 (strict)
    reason: str
    temperature: float
    tasks: dict[str, list[str]]  # task -> the question ids measured
    table: list[Candidate] = field(default_factory=list)
    drafting: dict[str, Any] = field(default_factory=dict)  # k, draft_quant, ... of the runs


def validate_budget(budget: float) -> float:
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and 0 < budget <= 1):
        raise MarspecError(
            f"--budget must be a recovery in (0, 1], e.g. 0.99 (keep at least 99% of strict's score), "
            f"got {budget}"
        )
    return float(budget)


def choose(candidates: list[Candidate], budget: float) -> tuple[str, float, bool, str]:
    """(margin, theta, met_budget, reason): the candidate with the highest geometric-mean speedup over
    strict across tasks among those whose recovery lower bound is at least ``budget`` on every task;
    theta 1 (strict, which MARS at theta 1 equals) if none is."""
    validate_budget(budget)
    by_setting: dict[tuple[str, float], list[Candidate]] = {}
    for c in candidates:
        by_setting.setdefault((c.margin, c.theta), []).append(c)
    tasks = {c.task for c in candidates}
    eligible = []
    for (margin, theta), rows in by_setting.items():
        if {r.task for r in rows} != tasks:
            continue
        if any(r.recovery_lo is None or r.recovery_lo < budget or not r.speedup_vs_strict for r in rows):
            continue
        speed = math.exp(sum(math.log(r.speedup_vs_strict) for r in rows) / len(rows))  # type: ignore[arg-type]
        eligible.append((speed, margin, theta))
    if not eligible:
        return (
            "logit_ratio",
            1.0,
            False,
            f"no candidate's recovery lower bound reached {budget:.1%} on every task: theta 1 (strict)",
        )
    speed, margin, theta = max(eligible)
    return (
        margin,
        theta,
        True,
        f"fastest ({speed:.3f}x strict, geometric mean over tasks) of {len(eligible)} settings whose "
        f"recovery lower bound is >= {budget:.1%} on every task",
    )


def calibration_path(target: str, draft: str, target_quant: str = "none") -> Path:
    """Where the calibration of a pair lives (one file for both regimes): in the model cache's
    ``calibrations`` folder, or in $MARSPEC_CALIBRATION_DIR. A quantised target is another model, so its
    calibration is a file of its own (named with ``target_quant``)."""
    names = (target, draft) if target_quant == "none" else (target, draft, target_quant)
    safe = "__".join(_file_safe(name) for name in names)
    folder = os.environ.get("MARSPEC_CALIBRATION_DIR")
    return (Path(folder).expanduser() if folder else cache_dir() / "calibrations") / f"{safe}.json"


def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def _how_to(target: str, draft: str, regime: Regime, target_quant: str = "none") -> str:
    temp = " --temperature 1.0" if regime == "sampling" else ""
    return f"marspec calibrate --target {target} --draft {draft} --target-quant {target_quant}{temp}"


def read_calibration_file(path: Path, target: str, draft: str) -> dict[str, Any] | None:
    """The file's contents, None if there is none; a clear error if it is unreadable or another pair's."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
            raise ValueError(f"not a version {FILE_VERSION} calibration file")
    except (OSError, ValueError) as exc:
        raise MarspecError(
            f"the calibration file {path} is corrupt ({exc}): delete it and run "
            f"`{_how_to(target, draft, 'greedy')}` again"
        ) from None
    if (data.get("target"), data.get("draft")) != (target, draft):
        raise MarspecError(
            f"the calibration file {path} is for target {data.get('target')!r} with draft "
            f"{data.get('draft')!r}, not {target!r} with {draft!r}: delete it and calibrate this pair"
        )
    return data


def load_choice(target: str, draft: str, temperature: float, target_quant: str = "none") -> Rule:
    """The calibrated MARS rule for this pair (its target in ``target_quant``) at this temperature
    (greedy or sampling)."""
    regime = regime_of(temperature)
    path = calibration_path(target, draft, target_quant)
    data = read_calibration_file(path, target, draft)
    entry = None if data is None else data.get(regime)
    if entry is None:
        target_named = target if target_quant == "none" else f"{target} ({target_quant})"
        raise MarspecError(
            f"theta='auto' needs a {regime} calibration of target {target_named!r} with draft {draft!r} "
            f"and there is none: run `{_how_to(target, draft, regime, target_quant)}` (or give theta a "
            "number)"
        )
    try:
        return Rule(name="mars", theta=float(entry["theta"]), margin=entry["margin"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MarspecError(
            f"the calibration file {path} is corrupt (bad {regime} entry: {exc}): delete it and run "
            f"`{_how_to(target, draft, regime, target_quant)}` again"
        ) from None


def save_choice(target: str, draft: str, choice: Choice, target_quant: str = "none") -> Path:
    """Store ``choice`` for the pair's regime (its target in ``target_quant``), keeping the other
    regime's entry; written atomically, so a failure never leaves a half-written file."""
    Rule(name="mars", theta=choice.theta, margin=choice.margin)  # store only what theta="auto" can use
    path = calibration_path(target, draft, target_quant)
    data = read_calibration_file(path, target, draft) or {
        "version": FILE_VERSION,
        "target": target,
        "draft": draft,
    }
    data[regime_of(choice.temperature)] = asdict(choice)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path
