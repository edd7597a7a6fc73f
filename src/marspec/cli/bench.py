"""Benchmark commands: ``bench``, ``sweep``, ``compare``, ``report`` and ``profile``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from marspec.cli.common import LoadSettings, app, err, load_decoder, print_summary, user_errors
from marspec.cli.options import (
    DeviceOpt,
    DraftConfidenceOpt,
    DraftOpt,
    DraftQuantOpt,
    DtypeOpt,
    GraphsOpt,
    KOpt,
    LimitOpt,
    LookupOpt,
    MarginOpt,
    MaxNewOpt,
    OutOpt,
    PlainLimitOpt,
    PrepackOpt,
    SamplesOpt,
    TargetOpt,
    TargetQuantOpt,
    TaskOpt,
    TemperatureOpt,
    ThetaOpt,
    ThreadsOpt,
    TreeOpt,
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
from marspec.errors import MarspecError
from marspec.eval.method_names import METHOD_HELP, PLAIN, REFERENCE
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.progress import status

MethodsOpt = Annotated[str, typer.Option("--methods", help=f"Comma-separated: {METHOD_HELP}")]
OffsetOpt = Annotated[
    int, typer.Option("--offset", help="Skip the first N questions (e.g. a calibration's slice).")
]
PrefixReuseOpt = Annotated[
    bool,
    typer.Option(
        "--prefix-reuse/--no-prefix-reuse",
        help="Later turns of a conversation keep the cache of the earlier ones (marspec's methods).",
    ),
]
RedoContendedOpt = Annotated[
    bool,
    typer.Option(
        "--redo-contended",
        help="Decode again the records made while other processes loaded the machine (their "
        "timings are suspect; the summary counts them).",
    ),
]
RedoOtherCpuOpt = Annotated[
    bool,
    typer.Option(
        "--redo-other-cpu",
        help="Decode again the records made on another processor model (a run resumed on another "
        "machine) where their question's sample is also decoded here (a method added, a record "
        "redone), so each question's speed ratios come from one CPU; a sample whole on another CPU "
        "is kept.",
    ),
]
RedoApartOpt = Annotated[
    bool,
    typer.Option(
        "--redo-apart",
        help="Decode again, back to back, every listed method of a question whose records were timed "
        "in different sittings or on different CPUs (a method added to a run later, a baseline "
        "decoded again): their speed ratios are measurements only when timed together.",
    ),
]


def bench_task(
    out: Path, temperature: float, samples: int, plain_limit: int | None = None, **settings: Any
) -> None:
    """Run :func:`marspec.eval.harness.run_task` with the CLI's model loader and progress on stderr,
    then print the summary: what `marspec bench` and `sweep` run."""
    from marspec.eval.harness import SamplingSettings, run_task

    sampling = SamplingSettings(temperature, samples, plain_limit)
    print_summary(run_task(out=out, sampling=sampling, load=load_decoder, console=err, **settings), out)


@app.command()
def bench(
    task: TaskOpt = "gsm8k",
    limit: LimitOpt = None,
    methods: MethodsOpt = "plain,strict,mars,hf-assisted",
    theta: ThetaOpt = None,
    margin: MarginOpt = None,
    k: KOpt = DEFAULT_K,
    out: OutOpt = Path("runs/bench"),
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    graphs: GraphsOpt = "auto",
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    max_new_tokens: MaxNewOpt = None,
    tree: TreeOpt = None,
    temperature: TemperatureOpt = 0.0,
    samples: SamplesOpt = 1,
    plain_limit: PlainLimitOpt = None,
    offset: OffsetOpt = 0,
    prefix_reuse: PrefixReuseOpt = True,
    redo_contended: RedoContendedOpt = False,
    redo_other_cpu: RedoOtherCpuOpt = False,
    redo_apart: RedoApartOpt = False,
) -> None:
    """Benchmark methods side by side on a task: speedup, tau, acceptance, score and recovery."""
    with user_errors():
        load_settings = LoadSettings(
            draft_quant, draft_confidence, lookup, prepack, device, target_quant, graphs
        )
        bench_task(
            task=task,
            limit=limit,
            method_spec=methods,
            theta=theta,
            margin=margin,
            k=k,
            out=out,
            target=target,
            draft=draft,
            dtype=dtype,
            threads=threads,
            max_new_tokens=max_new_tokens,
            load_settings=load_settings,
            tree=tree,
            temperature=temperature,
            samples=samples,
            plain_limit=plain_limit,
            offset=offset,
            prefix_reuse=prefix_reuse,
            redo_contended=redo_contended,
            redo_other_cpu=redo_other_cpu,
            redo_apart=redo_apart,
        )


@app.command()
def sweep(
    task: TaskOpt = "gsm8k",
    thetas: Annotated[str, typer.Option("--thetas", help="Comma-separated thetas in [0, 1].")] = (
        "0.80,0.84,0.88,0.90,0.92,0.96,1.0"
    ),
    limit: LimitOpt = None,
    margin: MarginOpt = None,
    k: KOpt = DEFAULT_K,
    out: OutOpt = Path("runs/sweep"),
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    graphs: GraphsOpt = "auto",
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    max_new_tokens: MaxNewOpt = None,
    reference: Annotated[
        str,
        typer.Option(
            "--reference",
            help="plain, or strict: its equal in quality (token for token when greedy) at a fraction "
            "of plain's CPU time; speedups are then against strict.",
        ),
    ] = "plain",
    temperature: TemperatureOpt = 0.0,
    samples: SamplesOpt = 1,
) -> None:
    """The speed/quality curve: a reference and MARS at each theta in one run, then the plots."""
    with user_errors():
        values = []
        for item in thetas.split(","):
            try:
                values.append(float(item))
            except ValueError:
                raise MarspecError(f"--thetas: {item!r} is not a number (use e.g. 0.85,0.9,1.0)") from None
        if reference not in (PLAIN, REFERENCE):
            raise MarspecError(f"--reference must be plain or strict, got {reference!r}")
        spec = ",".join([reference, *(f"mars@{v:g}" for v in values)])
        load_settings = LoadSettings(
            draft_quant, draft_confidence, lookup, prepack, device, target_quant, graphs
        )
        bench_task(
            task=task,
            limit=limit,
            method_spec=spec,
            theta=None,
            margin=margin,
            k=k,
            out=out,
            target=target,
            draft=draft,
            dtype=dtype,
            threads=threads,
            max_new_tokens=max_new_tokens,
            load_settings=load_settings,
            temperature=temperature,
            samples=samples,
        )
    report(out)


@app.command()
def compare(
    reference: Annotated[str, typer.Argument(help="RUN_DIR:METHOD, the reference (e.g. runs/he:strict).")],
    other: Annotated[str, typer.Argument(help="RUN_DIR:METHOD to compare with it.")],
) -> None:
    """One method of a run against one of another run, on the questions both ran: recovery with its
    95% interval, answers lost and won, and where the tokens first differ (e.g. bf16 strict against fp32
    strict: rounding's noise floor)."""
    import statistics

    from marspec.eval.compare import compare_runs, parse_side

    with user_errors():
        c = compare_runs(parse_side(reference), parse_side(other))
    r, d = c.recovery, c.difference
    recovery = "—" if r.value is None else f"{r.value:.1%} [{r.lo:.1%}, {r.hi:.1%}]"
    parted = sorted(c.first_divergences)
    divergence = ""
    if parted:
        quartiles = (
            statistics.quantiles(parted, n=4, method="inclusive") if len(parted) > 1 else [parted[0]] * 3
        )
        divergence = (
            f"; tokens differ on {len(parted)}, from token {quartiles[1]:g} (median; quartiles "
            f"{quartiles[0]:g}-{quartiles[2]:g}, range {parted[0]}-{parted[-1]})"
        )
    Console().print(
        f"{c.questions} questions: score {c.score:.3f} vs {c.reference_score:.3f}; recovery {recovery}; "
        f"difference {d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]; text changed on {c.changed}, "
        f"lost {c.lost}, won {c.won}{divergence}",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="Directories written by `marspec bench` or `sweep`.")],
    as_html: Annotated[
        bool,
        typer.Option(
            "--html",
            help="Also write audit.html: every relaxed token in context beside the reference's output.",
        ),
    ] = False,
    combined: Annotated[
        Path | None,
        typer.Option(
            "--combined",
            help="Also write one Pareto plot (PNG) over all the RUNS, which must be whole runs of one "
            "task on the same questions (e.g. a MARS sweep and a run of rival rules).",
        ),
    ] = None,
    resummarize: Annotated[
        bool,
        typer.Option(
            "--resummarize",
            help="First rewrite each run's summary.json and summary.md from its records with this "
            "version's metrics (whole runs only; loads no model, decodes nothing).",
        ),
    ] = False,
) -> None:
    """Plots (PNG) for each benchmark directory: speed against recovery, theta curve, acceptance by
    position, margin distribution; with --html, the audit page of what the lossy rules changed."""
    from marspec.eval.report import combined_pareto, make_report
    from marspec.eval.rundir import SUMMARY_MD
    from marspec.eval.summary import resummarize as rewrite_summary

    with user_errors():
        for out in runs:
            if resummarize:
                rewrite_summary(out)
                err.print(f"rewrote {out / SUMMARY_MD}")
            for path in make_report(out):
                err.print(f"wrote {path}")
            if as_html:
                from marspec.eval.audit import write_audit

                err.print(f"wrote {write_audit(out)}")
        if combined is not None:
            err.print(f"wrote {combined_pareto(runs, combined)}")


@app.command()
def profile(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    graphs: GraphsOpt = "auto",
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Profile target forwards scoring 1..N tokens.")
    ] = DEFAULT_K + 1,
    context: Annotated[int, typer.Option("--context", help="Positions already cached.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", help="Forwards per size (median).")] = 5,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the costs as one JSON object.")] = False,
) -> None:
    """Forward cost of the target by number of scored tokens, and of the draft: the machine's limits."""
    from marspec.profile import profile_pair

    with user_errors():
        for name, value in (("--max-tokens", max_tokens), ("--context", context), ("--repeats", repeats)):
            if value < 1:
                raise MarspecError(f"{name} must be >= 1, got {value}")
        decoder = load_decoder(
            target,
            None if draft in ("none", "ngram") else draft,
            dtype,
            threads,
            LoadSettings(
                draft_quant, DEFAULT_DRAFT_CONFIDENCE, DEFAULT_LOOKUP, prepack, device, target_quant, graphs
            ),
        )
        draft_lm = decoder.drafter.draft_model if decoder.drafter else None
        with status(err, "measuring forwards"):
            costs = profile_pair(decoder.target, draft_lm, max_tokens, context, repeats)
    if as_json:
        print(json.dumps(costs.to_dict()))
        return
    import torch

    one = costs.target_s(1)
    table = Table(
        title=f"forward costs: {target} ({_kernels(dtype, prepack, target_quant)}, "
        f"{torch.get_num_threads()} threads, {context} cached positions)"
    )
    for col in ("scored tokens", "target ms", "x one-token step", "ms per scored token"):
        table.add_column(col, justify="right")
    for n, seconds in sorted(costs.target.items()):
        table.add_row(str(n), f"{seconds * 1000:.1f}", f"{seconds / one:.2f}", f"{seconds * 1000 / n:.1f}")
    Console().print(table)
    if costs.draft:
        d = costs.draft_s(1)
        Console().print(
            f"draft {draft} ({draft_quant}): {d * 1000:.1f} ms per token = {d / one:.2f} of a target step. "
            f"Bound: time per token >= (T_verify(K+1) + K x {d * 1000:.0f} ms) / tau."
        )


def _kernels(dtype: str, prepack: bool, target_quant: str) -> str:
    """How the target's linear layers run, for a table title."""
    if target_quant != "none":
        return f"{target_quant} linear layers"
    return dtype + (", oneDNN-prepacked" if prepack else "")
