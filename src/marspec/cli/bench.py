"""Benchmark commands: ``bench``, ``sweep``, ``compare``, ``report`` and ``profile``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from marspec.calibration import AUTO, load_choice, parse_theta
from marspec.cli.common import LoadSettings, SamplingSettings, app, err, load_decoder, user_errors
from marspec.cli.options import (
    DeviceOpt,
    DraftConfidenceOpt,
    DraftOpt,
    DraftQuantOpt,
    DtypeOpt,
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
    DEFAULT_K,
    DEFAULT_LOOKUP,
    DEFAULT_PREPACK,
    default_setting,
)
from marspec.errors import MarspecError
from marspec.eval.methods import METHOD_HELP
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.progress import progress, status


def bench_task(
    *,
    task: str,
    limit: int | None,
    method_spec: str,
    theta: str | None,
    margin: str | None,
    k: int,
    out: Path,
    target: str,
    draft: str,
    dtype: str,
    threads: int | None,
    max_new_tokens: int | None,
    load_settings: LoadSettings,
    tree: str | None = None,
    sampling: SamplingSettings | None = None,
    offset: int = 0,
    prefix_reuse: bool = True,
    redo_contended: bool = False,
    redo_other_cpu: bool = False,
) -> dict:
    """Benchmark ``method_spec`` on one task into ``out`` (resuming it), print the summary and return it:
    what `marspec bench`, `sweep` and `calibrate` run."""
    import torch

    from marspec.api import GenerationOptions
    from marspec.devices import resolve_device
    from marspec.eval.bench import (
        DEFAULT_MAX_NEW_TOKENS,
        BenchConfig,
        planned_runs,
        prepare_out_dir,
        profile_once,
        run_bench,
    )
    from marspec.eval.datasets import TASKS, load_task
    from marspec.eval.grading import grader_for
    from marspec.eval.methods import parse_methods
    from marspec.tree import parse_tree_shape

    if task not in TASKS:
        raise MarspecError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    if limit is not None and limit < 1:
        raise MarspecError(f"--limit must be >= 1, got {limit}")
    sampling = sampling or SamplingSettings()
    theta_value = parse_theta(theta)
    auto = None
    if theta_value == AUTO or "@auto" in method_spec:
        auto = load_choice(target, draft, sampling.temperature)
    if theta_value == AUTO:
        assert auto is not None
        theta_value, margin = auto.theta, auto.margin
    else:  # unset: the measured default for this run's temperature (kept in config.json as resolved)
        margin, theta_value = default_setting(sampling.temperature, margin, theta_value)
    assert isinstance(theta_value, float)
    methods = parse_methods(method_spec, theta_value, auto, margin)
    tree_shape = parse_tree_shape(tree)
    if tree_shape is not None and not any(m.tree for m in methods):
        raise MarspecError("--tree is set but no method drafts a tree: add e.g. mars+tree to --methods")
    if tree_shape is None and any(m.tree for m in methods):
        raise MarspecError("a +tree method needs a tree shape: pass --tree, e.g. --tree 2,2")
    new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task]
    GenerationOptions(  # validates the run's MARS setting (the methods' own rules are checked apart)
        rule="mars",
        theta=theta_value,
        margin=margin,
        k=k,
        max_new_tokens=new_tokens,
        temperature=sampling.temperature,
    )
    questions = load_task(task, limit, offset)
    needs_draft = any(m.needs_draft_model for m in methods)
    if threads is not None:
        torch.set_num_threads(threads)
    config = BenchConfig(
        task=task,
        methods=tuple(m.name for m in methods),
        theta=theta_value,
        margin=margin,
        k=k,
        max_new_tokens=new_tokens,
        target=target,
        draft=draft if needs_draft else "none",
        draft_quant=load_settings.draft_quant if needs_draft else "none",
        draft_confidence=load_settings.draft_confidence if needs_draft else 0.0,
        lookup=load_settings.lookup if needs_draft else False,
        dtype=dtype,
        threads=torch.get_num_threads(),
        tree=",".join(map(str, tree_shape)) if tree_shape else None,
        prepack=load_settings.prepack,
        target_quant=load_settings.target_quant,
        device=str(resolve_device(load_settings.device)),
        temperature=sampling.temperature,
        samples=sampling.samples,
        plain_limit=sampling.plain_limit,
        # Recorded only where it can matter, so single-turn runs stay comparable with older ones.
        prefix_reuse=prefix_reuse and any(len(q.turns) > 1 for q in questions),
    )
    prepare_out_dir(out, config)  # refuse a mismatched directory before spending a minute loading models
    decoder = load_decoder(target, draft if needs_draft else None, dtype, threads, load_settings)
    with status(err, "profiling forward costs (for achieved/ideal)"):
        profile_once(decoder, config, out)
    with progress(err, task, planned_runs(questions, methods, config), eta=True) as advance:

        def done(question, method, sample: int, skipped: bool) -> None:
            which = f" sample {sample}" if config.samples > 1 else ""
            advance(f"{question.qid}{which} {method.name}", skipped=skipped)

        summary = run_bench(
            decoder, questions, methods, config, out, grader_for(task), done, redo_contended, redo_other_cpu
        )
    from marspec.eval.bench import summary_markdown

    Console().print(summary_markdown(summary))
    err.print(f"results in {out}")
    return summary


@app.command()
def bench(
    task: TaskOpt = "gsm8k",
    limit: LimitOpt = None,
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            help=f"Comma-separated: {METHOD_HELP}",
        ),
    ] = "plain,strict,mars,hf-assisted",
    theta: ThetaOpt = None,
    margin: MarginOpt = None,
    k: KOpt = DEFAULT_K,
    out: OutOpt = Path("runs/bench"),
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = "none",
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "fp32",
    threads: ThreadsOpt = None,
    max_new_tokens: MaxNewOpt = None,
    tree: TreeOpt = None,
    temperature: TemperatureOpt = 0.0,
    samples: SamplesOpt = 1,
    plain_limit: PlainLimitOpt = None,
    offset: Annotated[
        int, typer.Option("--offset", help="Skip the first N questions (e.g. a calibration's slice).")
    ] = 0,
    prefix_reuse: Annotated[
        bool,
        typer.Option(
            "--prefix-reuse/--no-prefix-reuse",
            help="Later turns of a conversation keep the cache of the earlier ones (marspec's methods).",
        ),
    ] = True,
    redo_contended: Annotated[
        bool,
        typer.Option(
            "--redo-contended",
            help="Decode again the records made while other processes loaded the machine (their "
            "timings are suspect; the summary counts them).",
        ),
    ] = False,
    redo_other_cpu: Annotated[
        bool,
        typer.Option(
            "--redo-other-cpu",
            help="Decode again the records made on another processor model (a run resumed on another "
            "machine), so each question's speed ratios come from one CPU.",
        ),
    ] = False,
) -> None:
    """Benchmark methods side by side on a task: speedup, tau, acceptance, score and recovery."""
    with user_errors():
        load_settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device, target_quant)
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
            sampling=SamplingSettings(temperature, samples, plain_limit),
            offset=offset,
            prefix_reuse=prefix_reuse,
            redo_contended=redo_contended,
            redo_other_cpu=redo_other_cpu,
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
    target_quant: TargetQuantOpt = "none",
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "fp32",
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
        if reference not in ("plain", "strict"):
            raise MarspecError(f"--reference must be plain or strict, got {reference!r}")
        spec = ",".join([reference, *(f"mars@{v:g}" for v in values)])
        load_settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device, target_quant)
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
            sampling=SamplingSettings(temperature, samples),
        )
    report(out)


@app.command()
def compare(
    reference: Annotated[str, typer.Argument(help="RUN_DIR:METHOD, the reference (e.g. runs/he:strict).")],
    other: Annotated[str, typer.Argument(help="RUN_DIR:METHOD to compare with it.")],
) -> None:
    """One method of a run against one of another run, on the questions both ran: recovery with its
    95% interval, answers lost and won (e.g. bf16 strict against fp32 strict: rounding's noise floor)."""
    from marspec.eval.compare import compare_runs, parse_side

    with user_errors():
        c = compare_runs(parse_side(reference), parse_side(other))
    r, d = c.recovery, c.difference
    recovery = "—" if r.value is None else f"{r.value:.1%} [{r.lo:.1%}, {r.hi:.1%}]"
    Console().print(
        f"{c.questions} questions: score {c.score:.3f} vs {c.reference_score:.3f}; recovery {recovery}; "
        f"difference {d.value:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]; text changed on {c.changed}, "
        f"lost {c.lost}, won {c.won}",
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
    from marspec.eval.bench import SUMMARY_MD
    from marspec.eval.bench import resummarize as rewrite_summary
    from marspec.eval.report import combined_pareto, make_report

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
    target_quant: TargetQuantOpt = "none",
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Profile target forwards scoring 1..N tokens.")
    ] = DEFAULT_K + 1,
    context: Annotated[int, typer.Option("--context", help="Positions already cached.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", help="Forwards per size (median).")] = 5,
    dtype: DtypeOpt = "fp32",
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
                draft_quant, DEFAULT_DRAFT_CONFIDENCE, DEFAULT_LOOKUP, prepack, device, target_quant
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
