"""Calibration: measure MARS settings against strict verification and store the choice (what
``marspec calibrate`` and ``marspec choose`` run; :func:`calibrate` and :func:`choice_from_runs`).

Each task of the calibration slice is one resumable benchmark run (``DIR/TASK-tT``) of ``strict`` and
the candidate settings, interleaved question by question. Strict is the quality reference (it equals plain
decoding, token for token when greedy and in distribution when sampling) and the speed reference, so
plain decoding, the most expensive method, is not needed here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marspec.calibration import (
    DEFAULT_CANDIDATES,
    Candidate,
    Choice,
    calibration_path,
    choose,
    read_calibration_file,
    save_choice,
    validate_budget,
)
from marspec.defaults import DEFAULT_DTYPE, DEFAULT_K
from marspec.errors import MarspecError
from marspec.eval.harness import DecoderLoader, SamplingSettings, new_decoder, run_task, with_precision
from marspec.eval.method_names import REFERENCE
from marspec.eval.methods import Method, parse_methods
from marspec.eval.rundir import load_records, read_run
from marspec.load_settings import LoadSettings
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.settings import settle_rule

if TYPE_CHECKING:
    from rich.console import Console

# Tasks with a grader: a calibration ranks settings by recovery of a task score.
GRADED_TASKS = ("humaneval", "gsm8k")

# What a calibration stores is a margin and a theta; these must match between runs for their rows to be
# read as one measurement of the same drafting.
SHARED_RUN_FIELDS = (
    "target", "draft", "draft_quant", "draft_confidence", "lookup", "prepack",
    "dtype", "k", "max_new_tokens", "temperature", "samples",
)  # fmt: skip


def calibrate(
    *,
    target: str = DEFAULT_TARGET,
    draft: str = DEFAULT_DRAFT,
    tasks: Sequence[str] = GRADED_TASKS,
    limit: int = 30,
    budget: float = 0.99,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    temperature: float = 0.0,
    samples: int = 1,
    k: int = DEFAULT_K,
    dtype: str = DEFAULT_DTYPE,
    threads: int | None = None,
    max_new_tokens: int | None = None,
    load_settings: LoadSettings | None = None,
    out: Path = Path("runs/calibrate"),
    load: DecoderLoader = new_decoder,
    console: Console | None = None,
    on_task: Callable[[str, Path, dict[str, Any]], None] | None = None,
) -> tuple[Choice, Path]:
    """Choose MARS's setting for a model pair by measurement and store it for ``theta="auto"``.

    Runs strict and each candidate (``mars-ratio@T``, ``mars-prob@T``, ...) on the first ``limit``
    questions of each graded task (resumable, in ``out/TASK-tT``), then keeps the fastest candidate
    whose recovery's 95% lower bound reaches ``budget`` on every task (theta 1, i.e. strict, if none
    does). Returns the choice and the file it was stored in. ``on_task(task, folder, summary)`` is
    called as each task's benchmark finishes; ``load`` and ``console`` are :func:`run_task`'s.
    """
    validate_budget(budget)
    _check_slice(tasks, limit, draft)
    spec = ",".join(["strict", *candidates])
    methods = _candidate_methods(spec)
    # The target's precision, chosen once: the calibration is stored for it (another precision is
    # another model).
    load_settings, dtype = with_precision(target, load_settings or LoadSettings(), dtype)
    target_quant = load_settings.target_quant
    # A corrupt or foreign calibration file is refused now, not after hours of measuring.
    read_calibration_file(calibration_path(target, draft, target_quant), target, draft)
    rows: list[Candidate] = []
    questions = {}
    for name in tasks:
        folder = out / f"{name}-t{temperature:g}"
        summary = run_task(
            task=name,
            limit=limit,
            method_spec=spec,
            theta=None,
            margin=None,
            k=k,
            out=folder,
            target=target,
            draft=draft,
            dtype=dtype,
            threads=threads,
            max_new_tokens=max_new_tokens,
            load_settings=load_settings,
            sampling=SamplingSettings(temperature, samples),
            load=load,
            console=console,
        )
        if on_task is not None:
            on_task(name, folder, summary)
        rows += candidates_of(summary, methods, name)
        questions[name] = list(summary["qids"])
    drafting = {"k": k, "dtype": dtype, "samples": samples, **asdict(load_settings)}
    choice = make_choice(rows, budget, temperature, questions, drafting)
    return choice, save_choice(target, draft, choice, target_quant)


def _check_slice(tasks: Sequence[str], limit: int, draft: str) -> None:
    """Refuse, before any model loads, a calibration slice that cannot be measured."""
    for name in tasks:
        if name not in GRADED_TASKS:
            raise MarspecError(
                f"cannot calibrate on {name!r}: calibration needs a graded task ({', '.join(GRADED_TASKS)})"
            )
    if not tasks:
        raise MarspecError("--task is empty: give humaneval, gsm8k or both")
    if limit < 1:
        raise MarspecError(f"--limit must be >= 1, got {limit}")
    if draft == "none":
        raise MarspecError("calibration measures speculative decoding: give a drafter with --draft")


def _candidate_methods(spec: str) -> list[Method]:
    """The methods of ``spec`` (strict and the candidates), refused unless at least one is a MARS setting
    and every MARS setting is one a calibration can store."""
    run = settle_rule("mars")  # the run's own MARS setting: unused, each candidate names its own
    methods = parse_methods(spec, run.theta, margin=run.margin)
    unstorable = [m.name for m in methods if m.calibrates and not storable(m)]
    if unstorable:
        raise MarspecError(
            f"--candidates {', '.join(unstorable)}: a calibration stores a margin and a theta, which "
            "do not describe +next or +tree; compare those with marspec bench"
        )
    if not any(m.calibrates for m in methods):
        raise MarspecError("--candidates names no MARS setting: give e.g. mars-ratio@0.95,mars-prob@0.5")
    return methods


def storable(method: Method) -> bool:
    """Whether theta="auto" can stand for ``method``: a MARS setting without a guard or a tree, which a
    stored (margin, theta) does not describe."""
    return method.calibrates and method.guard == "none" and not method.tree


def candidates_of(summary: dict[str, Any], methods: Sequence[Method], task: str) -> list[Candidate]:
    """The candidate rows of one task's benchmark summary (strict is its reference for both speed and
    quality)."""
    strict = summary["methods"]["strict"]
    rows = []
    for m in methods:
        if not storable(m):
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
                speedup_vs_strict=_speedup_vs_strict(summary, m.name),
                tau_vs_strict=tau / strict_tau if tau and strict_tau else None,
                recovery=metrics["recovery"],
                recovery_lo=ci[0],
                recovery_hi=ci[1],
                questions=summary["questions"],
            )
        )
    return rows


def _speedup_vs_strict(summary: dict[str, Any], method: str) -> float | None:
    """``method``'s tokens/s over strict's on the questions both ran; for summaries older than the
    field, the speedup of a run whose speed baseline was strict (None for one measured against plain,
    which ``choice_from_runs`` refuses)."""
    metrics = summary["methods"][method]
    if "speedup_vs_strict" in metrics:
        return metrics["speedup_vs_strict"]
    return metrics["speedup"] if summary.get("baseline", REFERENCE) == REFERENCE else None


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


def choice_from_runs(run_dirs: Sequence[Path], budget: float) -> tuple[dict[str, Any], Choice]:
    """The choice finished ``marspec bench`` runs support, one run per task, without measuring again:
    (the runs' shared config, the choice). Each run must hold strict and at least one storable MARS
    setting, and all must share the drafting settings of SHARED_RUN_FIELDS."""
    if not run_dirs:
        raise MarspecError("give at least one benchmark run directory, e.g. runs/humaneval-30")
    configs, rows, tasks = [], [], {}
    for run in run_dirs:
        config, summary = read_run(run)
        task = config["task"]
        if task not in GRADED_TASKS:
            raise MarspecError(
                f"{run} ran {task!r}: calibration needs a graded task ({', '.join(GRADED_TASKS)})"
            )
        if task in tasks:
            raise MarspecError(f"two runs of {task!r} given ({run} and another): give one run per task")
        for earlier in configs:
            for key in SHARED_RUN_FIELDS:
                if earlier.get(key) != config.get(key):
                    raise MarspecError(
                        f"{run} differs from the other runs in {key} ({config.get(key)!r} vs "
                        f"{earlier.get(key)!r}): a calibration rests on runs with the same drafting settings"
                    )
        configs.append(config)
        methods = parse_methods(",".join(summary["methods"]), config["theta"], margin=config["margin"])
        if "strict" not in summary["methods"]:
            raise MarspecError(f"{run} has no strict runs: the reference a calibration measures against")
        found = candidates_of(summary, methods, task)
        if any(row.speedup_vs_strict is None for row in found):
            raise MarspecError(
                f"{run}'s summary predates speedups against strict (its speedups are against "
                f"{summary['baseline']}): rewrite it with `marspec report --resummarize {run}`"
            )
        if not found:
            raise MarspecError(
                f"{run} has no MARS setting to choose from (guarded and tree methods cannot be stored)"
            )
        rows += found
        tasks[task] = summary.get("qids") or _strict_qids(run)
    shared = configs[0]
    drafting = {key: shared.get(key) for key in SHARED_RUN_FIELDS if key not in ("target", "draft")}
    return shared, make_choice(rows, budget, float(shared.get("temperature", 0.0)), tasks, drafting)


def _strict_qids(run: Path) -> list[str]:
    """Question ids of strict's records, for summaries written before they listed their questions."""
    return list(dict.fromkeys(qid for qid, method, _ in load_records(run) if method == REFERENCE))
