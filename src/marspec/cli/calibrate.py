"""``calibrate`` (measure and store a theta for a model pair) and ``choose`` (pick from a run)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from marspec.calibration import DEFAULT_CANDIDATES, Choice
from marspec.cli.common import LoadSettings, app, err, load_decoder, print_summary, user_errors
from marspec.cli.options import (
    DeviceOpt,
    DraftConfidenceOpt,
    DraftOpt,
    DraftQuantOpt,
    DtypeOpt,
    KOpt,
    LookupOpt,
    MaxNewOpt,
    OutOpt,
    PrepackOpt,
    SamplesOpt,
    TargetOpt,
    TargetQuantOpt,
    TemperatureOpt,
    ThreadsOpt,
)
from marspec.defaults import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFT_QUANT,
    DEFAULT_DTYPE,
    DEFAULT_K,
    DEFAULT_LOOKUP,
    DEFAULT_PREPACK,
    DEFAULT_TARGET_QUANT,
)
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET


@app.command()
def calibrate(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    task: Annotated[
        str, typer.Option("--task", help="Comma-separated graded tasks: humaneval, gsm8k.")
    ] = "humaneval,gsm8k",
    limit: Annotated[int, typer.Option("--limit", help="Calibration questions per task (the first N).")] = 30,
    budget: Annotated[
        float,
        typer.Option("--budget", help="Least recovery (95% lower bound, vs strict) to accept, in (0, 1]."),
    ] = 0.99,
    candidates: Annotated[
        str, typer.Option("--candidates", help="Comma-separated settings: mars-ratio@T, mars-prob@T, ...")
    ] = ",".join(DEFAULT_CANDIDATES),
    temperature: TemperatureOpt = 0.0,
    samples: SamplesOpt = 1,
    k: KOpt = DEFAULT_K,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    max_new_tokens: MaxNewOpt = None,
    out: OutOpt = Path("runs/calibrate"),
) -> None:
    """Choose MARS's setting for a model pair by measurement, and store it for theta=auto.

    Runs strict and each candidate on the first --limit questions of each task (resumable, in
    OUT/TASK-tT), then keeps the fastest candidate whose recovery's 95% lower bound reaches --budget on
    every task (theta 1, i.e. strict, if none does)."""
    from marspec.eval.calibrate import calibrate as run_calibration

    with user_errors():
        choice, path = run_calibration(
            target=target,
            draft=draft,
            tasks=[t.strip() for t in task.split(",") if t.strip()],
            limit=limit,
            budget=budget,
            candidates=[c.strip() for c in candidates.split(",")],
            temperature=temperature,
            samples=samples,
            k=k,
            dtype=dtype,
            threads=threads,
            max_new_tokens=max_new_tokens,
            load_settings=LoadSettings(draft_quant, draft_confidence, lookup, prepack, device, target_quant),
            out=out,
            load=load_decoder,
            console=err,
            on_task=lambda name, folder, summary: print_summary(summary, folder),
        )
    _print_calibration(target, draft, choice, path)


@app.command()
def choose(
    runs: Annotated[list[Path], typer.Argument(help="Finished bench runs, one per task (humaneval, gsm8k).")],
    budget: Annotated[
        float,
        typer.Option("--budget", help="Least recovery (95% lower bound, vs strict) to accept, in (0, 1]."),
    ] = 0.99,
) -> None:
    """Choose MARS's setting from bench runs you already have, and store it for theta=auto.

    Each run must hold strict and MARS settings (e.g. a sweep); nothing is measured again. The choice
    follows calibrate's rule, for the runs' pair, drafting settings and temperature."""
    from marspec.calibration import calibration_path, read_calibration_file, save_choice, validate_budget
    from marspec.eval.calibrate import choice_from_runs

    with user_errors():
        validate_budget(budget)
        config, choice = choice_from_runs(runs, budget)
        target, draft = config["target"], config["draft"]
        target_quant = config.get("target_quant", "none")  # runs from before quantised targets had none
        read_calibration_file(calibration_path(target, draft, target_quant), target, draft)
        path = save_choice(target, draft, choice, target_quant)
    _print_calibration(target, draft, choice, path)


def _print_calibration(target: str, draft: str, choice: Choice, path: Path) -> None:
    """The candidates' table and the choice, as calibrate and choose report them."""
    regime = "greedy" if not choice.temperature else f"temperature {choice.temperature:g}"
    # Borderless and unwrapped: a bordered table squeezed into 80 columns cut the settings' names.
    table = Table(
        title=f"calibration of {target} with {draft} ({regime}), against strict",
        caption="* the choice; n: questions per task",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("setting", "task", "speedup", "tau", "recovery [95% CI]", "n"):
        table.add_column(col, justify="left" if col in ("setting", "task") else "right", no_wrap=True)
    for r in choice.table:
        chosen = (r.margin, r.theta) == (choice.margin, choice.theta)
        recovery = (
            "—" if r.recovery is None else f"{r.recovery:.1%} [{r.recovery_lo:.1%}, {r.recovery_hi:.1%}]"
        )
        table.add_row(
            f"{r.method}{' *' if chosen else ''}",
            r.task,
            "—" if r.speedup_vs_strict is None else f"{r.speedup_vs_strict:.3f}x",
            "—" if r.tau_vs_strict is None else f"{r.tau_vs_strict:.3f}x",
            recovery,
            str(r.questions),
        )
    Console().print(table)
    err.print(
        f"chose {choice.margin} theta={choice.theta:g}: {choice.reason}. Stored in {path}; "
        "theta=auto (--theta auto) now uses it.",
        highlight=False,
        soft_wrap=True,
    )
