"""The ``marspec`` command line: thin wrappers that parse, call the library and print."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from marspec.calibration import AUTO, Choice, load_choice, parse_theta
from marspec.defaults import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFT_QUANT,
    DEFAULT_K,
    DEFAULT_LOOKUP,
    DEFAULT_MARGIN,
    DEFAULT_PREPACK,
    DEFAULT_THETA,
)
from marspec.errors import MarspecError
from marspec.eval.calibrate import DEFAULT_CANDIDATES as CALIBRATION_CANDIDATES
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS
from marspec.progress import progress, status

app = typer.Typer(
    help="Speculative decoding with margin-aware verification (MARS).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

TargetOpt = Annotated[
    str, typer.Option("--target", help="Target model: a known name, HF folder or .gguf file.")
]
DraftOpt = Annotated[
    str, typer.Option("--draft", help="Draft model name/path, 'ngram' for prompt lookup, or 'none'.")
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="fp32 (exact; default) or bf16 (half the memory).")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="torch threads (default: torch's choice).")]
ThetaOpt = Annotated[
    str,
    typer.Option(
        "--theta",
        help="MARS's close-call threshold for --margin (default 0.5 on p2/p1: relax where the target prefers "
        "its top choice at most 2x; chosen by measurement, docs/results.md), 1 = strict; or 'auto': the "
        "setting `marspec calibrate` chose for this target and draft; a rival rule's parameter.",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto | cpu | cuda | cuda:N | mps: where models, caches and verification run (auto: a GPU if "
        "there is one); int8 drafts and prepacking are CPU kernels. Only cpu is tested by this project.",
    ),
]
MarginOpt = Annotated[
    str,
    typer.Option(
        "--margin", help="prob_ratio (p2/p1, the default) | logit_ratio (the paper's z2/z1) | logit_gap"
    ),
]
KOpt = Annotated[
    int, typer.Option("--k", help="Most draft tokens per step (>= 1); drafts end early when unsure.")
]
TreeOpt = Annotated[
    str | None,
    typer.Option(
        "--tree",
        help="Token-tree drafting (greedy): candidates per depth, e.g. 2,2 also verifies the draft's "
        "runner-up at depths 1 and 2 in the same forward.",
    ),
]
DraftQuantOpt = Annotated[
    str, typer.Option("--draft-quant", help="int8 (default: ~3x cheaper draft forwards) or none.")
]
DraftConfidenceOpt = Annotated[
    float,
    typer.Option("--draft-confidence", help="End a draft at a token the draft is less sure of; 0 = never."),
]
LookupOpt = Annotated[
    bool, typer.Option("--lookup/--no-lookup", help="Try prompt lookup before the draft model.")
]
PrepackOpt = Annotated[
    bool,
    typer.Option(
        "--prepack/--no-prepack", help="oneDNN-prepacked linear weights: ~3x cheaper multi-token forwards."
    ),
]


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a MarspecError into one line on stderr and exit status 2."""
    try:
        yield
    except MarspecError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


_loaded: dict[tuple, Any] = {}  # the last Decoder loaded, by its arguments (calibrate runs several tasks)


@dataclass(frozen=True)
class LoadSettings:
    """The drafter and kernel settings every model-loading command takes (Decoder's keyword arguments
    of the same names)."""

    draft_quant: str
    draft_confidence: float
    lookup: bool
    prepack: bool
    device: str = "auto"


def _load_decoder(target: str, draft: str | None, dtype: str, threads: int | None, settings: LoadSettings):
    """Load the models, or reuse the pair the last call loaded with the same arguments."""
    from marspec.api import Decoder  # torch/transformers import takes seconds: only when needed

    key = (target, draft, dtype, threads, settings)
    if key not in _loaded:
        _loaded.clear()  # hold one pair of models at a time
        with status(err, f"loading {target}" + (f" and {draft}" if draft and draft != "none" else "")):
            _loaded[key] = Decoder(target, draft, dtype=dtype, threads=threads, **asdict(settings))
    return _loaded[key]


@app.command()
def generate(
    prompt: Annotated[
        str, typer.Argument(help="The prompt (a chat template is applied for instruct models).")
    ],
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    rule: Annotated[
        str, typer.Option("--rule", help="plain | strict | mars; rivals: typical | pthresh | topk (--theta)")
    ] = "mars",
    theta: ThetaOpt = str(DEFAULT_THETA),
    margin: MarginOpt = DEFAULT_MARGIN,
    k: KOpt = DEFAULT_K,
    adaptive_k: Annotated[
        bool, typer.Option("--adaptive-k", help="Grow/shrink the draft length with acceptance (max --k).")
    ] = False,
    tree: TreeOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Upper bound on new tokens.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    dtype: DtypeOpt = "fp32",
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object.")] = False,
) -> None:
    """Generate text for PROMPT, streaming it (or printing one JSON object with --json)."""
    from marspec.api import GenerationOptions

    with user_errors():
        if not prompt.strip():
            raise MarspecError("empty prompt: give some text to continue")
        options = GenerationOptions(
            rule=rule,
            theta=parse_theta(theta),
            margin=margin,
            k=k,
            adaptive_k=adaptive_k,
            temperature=temperature,
            seed=seed,
            max_new_tokens=max_new_tokens,
            stop=stop or None,
            tree=tree,
        )
        decoder = _load_decoder(
            target,
            None if rule == "plain" else draft,
            dtype,
            threads,
            LoadSettings(draft_quant, draft_confidence, lookup, prepack, device),
        )
        opts = asdict(options)
        if as_json:
            result = decoder.generate(prompt, **opts)
            print(json.dumps(result.to_dict()))
            return
        result = decoder.generate(prompt, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()), **opts)
        sys.stdout.write("\n")
        s = result.stats
        err.print(
            f"[dim]{s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.2f} tok/s), tau {s.tau:.2f}, "
            f"accepted {s.accepted_exact} exact + {s.accepted_relaxed} relaxed, {s.rejected} rejections, "
            f"overhead {s.overhead_s * 1000:.0f} ms, finish: {result.finish_reason}[/]"
        )


@app.command()
def demo(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    theta: ThetaOpt = str(DEFAULT_THETA),
    k: KOpt = DEFAULT_K,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="New tokens per prompt.")] = 128,
    dtype: DtypeOpt = "fp32",
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Also print the summary as JSON.")] = False,
) -> None:
    """Plain vs strict speculative vs MARS decoding side by side on built-in prompts (code, math, chat)."""
    from marspec.api import GenerationOptions, GenerationResult
    from marspec.demo import DEMO_PROMPTS, METHODS, run_demo

    with user_errors():
        theta_value = parse_theta(theta)
        GenerationOptions(theta=theta_value, k=k, max_new_tokens=max_new_tokens)  # fail fast, before loading
        if draft in ("none",):
            raise MarspecError(
                "the demo compares speculative methods: give a drafter with --draft NAME|ngram"
            )
        decoder = _load_decoder(
            target,
            draft,
            dtype,
            threads,
            LoadSettings(draft_quant, draft_confidence, lookup, prepack, device),
        )
        decoder.resolve_theta(GenerationOptions(theta=theta_value))  # theta=auto: calibrated? (fail fast)
        total = len(DEMO_PROMPTS) * len(METHODS)
        with progress(err, "generating", total) as advance:

            def done(kind: str, method: str, result: GenerationResult) -> None:
                s = result.stats
                advance(f"{kind:<4} {method:<6} {s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s")

            summaries = run_demo(
                decoder, k=k, theta=theta_value, max_new_tokens=max_new_tokens, on_result=done
            )

    plain = summaries[0]
    table = Table(
        title=f"marspec demo: target {target}, draft {draft}, {dtype}, k={k}, theta={theta}, "
        f"{len(DEMO_PROMPTS)} prompts x {max_new_tokens} new tokens"
    )
    for col in ("method", "tokens", "tok/s", "speedup", "tau", "relaxed share", "overhead", "same as plain"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for s in summaries:
        table.add_row(
            s.name,
            str(s.tokens),
            f"{s.mean_tokens_per_s:.2f}",
            f"{s.mean_tokens_per_s / plain.mean_tokens_per_s:.2f}x",
            f"{s.tau:.2f}",
            f"{s.relaxed_share:.1%}",
            f"{s.overhead_share:.1%}",
            f"{s.same_as_plain}/{len(s.results)}",
        )
    Console().print(table)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "method": s.name,
                        "tokens": s.tokens,
                        "tokens_per_s": s.mean_tokens_per_s,
                        "speedup": s.mean_tokens_per_s / plain.mean_tokens_per_s,
                        "tau": s.tau,
                        "relaxed_share": s.relaxed_share,
                        "overhead_share": s.overhead_share,
                        "same_as_plain": s.same_as_plain,
                        "prompts": len(s.results),
                    }
                    for s in summaries
                ]
            )
        )


@app.command()
def models(
    prepare: Annotated[
        list[str] | None, typer.Option("--prepare", help="Convert a model into the cache now (repeatable).")
    ] = None,
) -> None:
    """List the known models, or convert some into the cache ahead of time."""
    from marspec.models import cache_dir, resolve_model_dir

    with user_errors():
        for name in prepare or []:
            path = resolve_model_dir(name)
            err.print(f"{name}: ready at {path}")
        if prepare:
            return
    table = Table(title=f"known models (cache: {cache_dir()})")
    for col in ("name", "role", "description"):
        table.add_column(col)
    for name, spec in MODELS.items():
        role = (
            "default target" if name == DEFAULT_TARGET else "default draft" if name == DEFAULT_DRAFT else ""
        )
        table.add_row(name, role, spec.description)
    Console().print(table)


@dataclass(frozen=True)
class SamplingSettings:
    """How a benchmark decodes: greedily (temperature 0) or sampled ``samples`` times per question."""

    temperature: float = 0.0
    samples: int = 1
    plain_limit: int | None = None


TemperatureOpt = Annotated[
    float, typer.Option("--temperature", help="0 = greedy; > 0 samples (seeds shared by all methods).")
]
SamplesOpt = Annotated[
    int, typer.Option("--samples", help="Decodes per question and method (needs --temperature > 0).")
]
PlainLimitOpt = Annotated[
    int | None,
    typer.Option(
        "--plain-limit",
        help="Run plain on the first N questions only (the speed baseline); strict is the quality reference.",
    ),
]
LimitOpt = Annotated[
    int | None, typer.Option("--limit", help="First N questions of the task (default: all).")
]
OutOpt = Annotated[
    Path, typer.Option("--out", help="Results directory (resumes a run with the same config).")
]
TaskOpt = Annotated[str, typer.Option("--task", help="humaneval | gsm8k | mtbench")]
MaxNewOpt = Annotated[
    int | None, typer.Option("--max-new-tokens", help="Per turn (default: long enough to finish; 512).")
]


def _run_bench(
    task: str,
    limit: int | None,
    method_spec: str,
    theta: str,
    margin: str,
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
) -> dict:
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
    assert isinstance(theta_value, float)
    methods = parse_methods(method_spec, theta_value, auto)
    tree_shape = parse_tree_shape(tree)
    if tree_shape is not None and not any(m.tree for m in methods):
        raise MarspecError("--tree is set but no method drafts a tree: add e.g. mars+tree to --methods")
    if tree_shape is None and any(m.tree for m in methods):
        raise MarspecError("a +tree method needs a tree shape: pass --tree, e.g. --tree 2,2")
    new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task]
    GenerationOptions(
        theta=theta_value, margin=margin, k=k, max_new_tokens=new_tokens, temperature=sampling.temperature
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
        device=str(resolve_device(load_settings.device)),
        temperature=sampling.temperature,
        samples=sampling.samples,
        plain_limit=sampling.plain_limit,
        # Recorded only where it can matter, so single-turn runs stay comparable with older ones.
        prefix_reuse=prefix_reuse and any(len(q.turns) > 1 for q in questions),
    )
    prepare_out_dir(out, config)  # refuse a mismatched directory before spending a minute loading models
    decoder = _load_decoder(target, draft if needs_draft else None, dtype, threads, load_settings)
    with status(err, "profiling forward costs (for achieved/ideal)"):
        profile_once(decoder, config, out)
    with progress(err, task, planned_runs(questions, methods, config), eta=True) as advance:

        def done(question, method, sample: int, skipped: bool) -> None:
            which = f" sample {sample}" if config.samples > 1 else ""
            advance(f"{question.qid}{which} {method.name}" + (" (done before)" * skipped))

        summary = run_bench(decoder, questions, methods, config, out, grader_for(task), done, redo_contended)
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
            help="Comma-separated: plain, strict, mars, mars@THETA, mars-ratio@THETA, mars-prob@THETA, "
            "mars-gap@THETA (marspec's with +tree too), hf-assisted, hf-prompt-lookup",
        ),
    ] = "plain,strict,mars,hf-assisted",
    theta: ThetaOpt = str(DEFAULT_THETA),
    margin: MarginOpt = DEFAULT_MARGIN,
    k: KOpt = DEFAULT_K,
    out: OutOpt = Path("runs/bench"),
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
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
) -> None:
    """Benchmark methods side by side on a task: speedup, tau, acceptance, score and recovery."""
    with user_errors():
        load_settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device)
        _run_bench(
            task,
            limit,
            methods,
            theta,
            margin,
            k,
            out,
            target,
            draft,
            dtype,
            threads,
            max_new_tokens,
            load_settings,
            tree,
            SamplingSettings(temperature, samples, plain_limit),
            offset,
            prefix_reuse,
            redo_contended,
        )


@app.command()
def sweep(
    task: TaskOpt = "gsm8k",
    thetas: Annotated[str, typer.Option("--thetas", help="Comma-separated thetas in [0, 1].")] = (
        "0.80,0.84,0.88,0.90,0.92,0.96,1.0"
    ),
    limit: LimitOpt = None,
    margin: MarginOpt = DEFAULT_MARGIN,
    k: KOpt = DEFAULT_K,
    out: OutOpt = Path("runs/sweep"),
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
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
        load_settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device)
        _run_bench(
            task,
            limit,
            spec,
            str(DEFAULT_THETA),
            margin,
            k,
            out,
            target,
            draft,
            dtype,
            threads,
            max_new_tokens,
            load_settings,
            sampling=SamplingSettings(temperature, samples),
        )
    report(out)


@app.command()
def calibrate(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
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
    ] = ",".join(CALIBRATION_CANDIDATES),
    temperature: TemperatureOpt = 0.0,
    samples: SamplesOpt = 1,
    k: KOpt = DEFAULT_K,
    dtype: DtypeOpt = "fp32",
    threads: ThreadsOpt = None,
    max_new_tokens: MaxNewOpt = None,
    out: OutOpt = Path("runs/calibrate"),
) -> None:
    """Choose MARS's setting for a model pair by measurement, and store it for theta=auto.

    Runs strict and each candidate on the first --limit questions of each task (resumable, in
    OUT/TASK-tT), then keeps the fastest candidate whose recovery's 95% lower bound reaches --budget on
    every task (theta 1, i.e. strict, if none does)."""
    from marspec.calibration import calibration_path, read_calibration_file, save_choice, validate_budget
    from marspec.eval.calibrate import candidates_of, make_choice, storable
    from marspec.eval.datasets import load_task
    from marspec.eval.methods import parse_methods

    with user_errors():
        validate_budget(budget)
        tasks = [t.strip() for t in task.split(",") if t.strip()]
        for name in tasks:
            if name not in ("humaneval", "gsm8k"):
                raise MarspecError(
                    f"cannot calibrate on {name!r}: calibration needs a graded task (humaneval, gsm8k)"
                )
        if not tasks:
            raise MarspecError("--task is empty: give humaneval, gsm8k or both")
        if limit < 1:
            raise MarspecError(f"--limit must be >= 1, got {limit}")
        if draft == "none":
            raise MarspecError("calibration measures speculative decoding: give a drafter with --draft")
        spec = f"strict,{candidates}"
        methods = parse_methods(spec, DEFAULT_THETA)
        unstorable = [m.name for m in methods if m.kind == "mars" and not storable(m)]
        if unstorable:
            raise MarspecError(
                f"--candidates {', '.join(unstorable)}: a calibration stores a margin and a theta, which "
                "do not describe +next or +tree; compare those with marspec bench"
            )
        if not any(m.kind == "mars" for m in methods):
            raise MarspecError("--candidates names no MARS setting: give e.g. mars-ratio@0.95,mars-prob@0.5")
        # A corrupt or foreign calibration file is refused now, not after hours of measuring.
        load_settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device)
        save_path = calibration_path(target, draft)
        read_calibration_file(save_path, target, draft)
        rows = []
        for name in tasks:
            summary = _run_bench(
                name,
                limit,
                spec,
                str(DEFAULT_THETA),
                DEFAULT_MARGIN,
                k,
                out / f"{name}-t{temperature:g}",
                target,
                draft,
                dtype,
                threads,
                max_new_tokens,
                load_settings,
                sampling=SamplingSettings(temperature, samples),
            )
            rows += candidates_of(summary, methods, name)
        questions = {name: [q.qid for q in load_task(name, limit)] for name in tasks}
        drafting = {"k": k, "dtype": dtype, "samples": samples, **asdict(load_settings)}
        choice = make_choice(rows, budget, temperature, questions, drafting)
        path = save_choice(target, draft, choice)
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
        read_calibration_file(calibration_path(target, draft), target, draft)
        path = save_choice(target, draft, choice)
    _print_calibration(target, draft, choice, path)


def _print_calibration(target: str, draft: str, choice: Choice, path: Path) -> None:
    """The candidates' table and the choice, as calibrate and choose report them."""
    regime = "greedy" if not choice.temperature else f"temperature {choice.temperature:g}"
    table = Table(title=f"calibration of {target} with {draft} ({regime})")
    for col in ("setting", "task", "speedup vs strict", "tau vs strict", "recovery [95% CI]", "questions"):
        table.add_column(col, justify="left" if col in ("setting", "task") else "right")
    for r in choice.table:
        chosen = (r.margin, r.theta) == (choice.margin, choice.theta)
        recovery = (
            "—" if r.recovery is None else f"{r.recovery:.1%} [{r.recovery_lo:.1%}, {r.recovery_hi:.1%}]"
        )
        table.add_row(
            f"{r.method}{' (chosen)' if chosen else ''}",
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
) -> None:
    """Plots (PNG) for each benchmark directory: speed against recovery, theta curve, acceptance by
    position, margin distribution; with --html, the audit page of what the lossy rules changed."""
    from marspec.eval.report import combined_pareto, make_report

    with user_errors():
        for out in runs:
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
        decoder = _load_decoder(
            target,
            None if draft in ("none", "ngram") else draft,
            dtype,
            threads,
            LoadSettings(draft_quant, DEFAULT_DRAFT_CONFIDENCE, DEFAULT_LOOKUP, prepack, device),
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
        title=f"forward costs: {target} ({dtype}{', oneDNN-prepacked' if prepack else ''}, "
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


@app.command()
def serve(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    draft_confidence: DraftConfidenceOpt = DEFAULT_DRAFT_CONFIDENCE,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0 picks a free one and prints it).")] = 8000,
    rule: Annotated[
        str, typer.Option("--rule", help="Default rule: plain | strict | mars | typical | pthresh | topk")
    ] = "mars",
    theta: ThetaOpt = str(DEFAULT_THETA),
    margin: Annotated[
        str, typer.Option("--margin", help="Default margin: logit_ratio | prob_ratio | logit_gap")
    ] = DEFAULT_MARGIN,
    k: KOpt = DEFAULT_K,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="max_tokens of requests that do not give one.")
    ] = 256,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests that may wait while one generates; more get 429.")
    ] = 8,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            help="Seconds from arrival; a generation then ends with its text so far, a queued request "
            "gets 503. 0 = no limit.",
        ),
    ] = 300.0,
    shutdown_grace: Annotated[
        float, typer.Option("--shutdown-grace", help="Seconds work may still finish after SIGTERM.")
    ] = 20.0,
    max_request_mb: Annotated[
        float,
        typer.Option(
            "--max-request-mb",
            help="Largest request body in MB (2**20 bytes); a larger one gets 413 before it is parsed.",
        ),
    ] = 4.0,
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="The `model` clients send (default: --target).")
    ] = None,
    dtype: DtypeOpt = "fp32",
    threads: ThreadsOpt = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
) -> None:
    """Serve an OpenAI-compatible HTTP API (chat and text completions, models, health, Prometheus metrics)."""
    with user_errors():
        try:
            from marspec.serve.server import bind_socket, run_server
            from marspec.serve.settings import ServerSettings
        except ImportError as exc:
            raise MarspecError(
                f"marspec serve needs the serve extra ({exc.name} is missing): pip install 'marspec[serve]'"
            ) from None
        from marspec.api import GenerationOptions

        if rule != "plain" and draft == "none":
            raise MarspecError(f"--rule {rule} needs a drafter: give --draft NAME|ngram, or use --rule plain")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if log_level not in levels:
            raise MarspecError(f"unknown --log-level {log_level!r}: choose one of {', '.join(levels)}")
        settings = ServerSettings(
            model_name=served_model_name or target,
            defaults=GenerationOptions(
                rule=rule, theta=parse_theta(theta), margin=margin, k=k, max_new_tokens=max_tokens
            ),
            max_queue=max_queue,
            request_timeout=request_timeout or None,
            shutdown_grace=shutdown_grace,
            max_request_bytes=round(max_request_mb * 2**20) if math.isfinite(max_request_mb) else 0,
        )
        sock = bind_socket(host, port)  # fail on a taken port before spending seconds loading models
        try:
            load_settings = LoadSettings(draft_quant, draft_confidence, lookup, prepack, device)
            decoder = _load_decoder(target, draft, dtype, threads, load_settings)
            decoder.resolve_theta(settings.defaults)  # theta=auto: refuse to start uncalibrated (greedy)
            where = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
            url = f"http://{where}:{sock.getsockname()[1]}"
            err.print(f"marspec serve: {settings.model_name} on {url}", highlight=False, soft_wrap=True)
            run_server(decoder, settings, sock, log_level)
        finally:
            sock.close()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
