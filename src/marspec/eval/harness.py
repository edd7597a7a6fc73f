"""From settings to a benchmark summary: what ``marspec bench``, ``sweep`` and ``calibrate`` run.

:func:`run_task` checks the settings, resolves the MARS setting (``theta="auto"`` and the measured
defaults), loads the questions and the models, profiles their forwards once and runs (or resumes) the
benchmark into a folder. The command line is a thin layer over it; a program calls it the same way:

    from pathlib import Path
    from marspec.eval.harness import run_task

    summary = run_task(task="gsm8k", method_spec="plain,strict,mars", out=Path("runs/gsm8k"), limit=10)

Importing this module is cheap (torch and the models load inside :func:`run_task`), so the CLI can take
its settings types at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marspec.defaults import DEFAULT_DTYPE, DEFAULT_K
from marspec.errors import MarspecError
from marspec.load_settings import LoadSettings
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

if TYPE_CHECKING:
    from rich.console import Console

    from marspec.api import Decoder
    from marspec.decode import DecodeConfig
    from marspec.eval.bench import BenchConfig
    from marspec.eval.datasets import Question
    from marspec.eval.methods import Method
    from marspec.progress import Advance
    from marspec.settings import Pair


@dataclass(frozen=True)
class SamplingSettings:
    """How a benchmark decodes: greedily (temperature 0) or sampled ``samples`` times per question."""

    temperature: float = 0.0
    samples: int = 1
    plain_limit: int | None = None


# (target, draft or None, dtype, threads, settings) -> a Decoder; the CLI passes one that keeps the last
# pair loaded, so a calibration over two tasks loads the models once.
DecoderLoader = Callable[[str, str | None, str, int | None, LoadSettings], "Decoder"]


def new_decoder(
    target: str, draft: str | None, dtype: str, threads: int | None, settings: LoadSettings
) -> Decoder:
    """A fresh :class:`~marspec.api.Decoder` with these settings (run_task's default loader)."""
    from marspec.api import Decoder

    return Decoder(target, draft, dtype=dtype, threads=threads, **asdict(settings))


def run_task(
    *,
    task: str,
    method_spec: str,
    out: Path,
    limit: int | None = None,
    theta: str | None = None,
    margin: str | None = None,
    k: int = DEFAULT_K,
    target: str = DEFAULT_TARGET,
    draft: str = DEFAULT_DRAFT,
    dtype: str = DEFAULT_DTYPE,
    threads: int | None = None,
    max_new_tokens: int | None = None,
    load_settings: LoadSettings | None = None,
    tree: str | None = None,
    sampling: SamplingSettings | None = None,
    offset: int = 0,
    prefix_reuse: bool = True,
    redo_contended: bool = False,
    redo_other_cpu: bool = False,
    redo_apart: bool = False,
    load: DecoderLoader = new_decoder,
    console: Console | None = None,
) -> dict[str, Any]:
    """Benchmark ``method_spec`` (e.g. ``"plain,strict,mars"``, see :data:`~marspec.eval.methods.METHOD_HELP`)
    on the first ``limit`` questions of ``task`` after ``offset``, into the folder ``out`` (resuming
    what it holds), and return the summary, also written there as ``summary.json`` and ``summary.md``.

    ``theta`` is a number, ``"auto"`` (the stored calibration) or None (the measured default for the
    temperature, with ``margin``). ``load`` makes the Decoder; with a ``console``, the loading, profiling
    and per-decode progress are shown on it. A bad setting raises a MarspecError before any model loads.
    """
    import torch

    from marspec.eval.bench import DEFAULT_MAX_NEW_TOKENS
    from marspec.eval.datasets import load_task
    from marspec.eval.rundir import prepare_out_dir
    from marspec.eval.runner import profile_once
    from marspec.settings import Pair

    _check_task(task, limit)
    load_settings, dtype = with_precision(target, load_settings or LoadSettings(), dtype)
    sampling = sampling or SamplingSettings()
    new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task]
    pair = Pair(target, draft, target_quant=load_settings.target_quant)
    run, methods = _settled_methods(
        method_spec, pair, theta, margin, k, new_tokens, sampling.temperature, tree
    )
    questions = load_task(task, limit, offset)
    needs_draft = any(m.needs_draft_model for m in methods)
    if threads is not None:
        torch.set_num_threads(threads)
    config = _bench_config(
        task=task,
        methods=methods,
        run=run,
        k=k,
        new_tokens=new_tokens,
        target=target,
        draft=draft if needs_draft else None,
        dtype=dtype,
        load_settings=load_settings,
        sampling=sampling,
        # Recorded only where it can matter, so single-turn runs stay comparable with older ones.
        prefix_reuse=prefix_reuse and any(len(q.turns) > 1 for q in questions),
    )
    prepare_out_dir(out, config)  # refuse a mismatched directory before spending a minute loading models
    decoder = load(target, draft if needs_draft else None, dtype, threads, load_settings)
    with _status(console, "profiling forward costs (for achieved/ideal)"):
        profile_once(decoder, config, out)
    return _run_with_progress(
        decoder, questions, methods, config, out, console, redo_contended, redo_other_cpu, redo_apart
    )


def with_precision(target: str, load_settings: LoadSettings, dtype: str) -> tuple[LoadSettings, str]:
    """The load settings and dtype with the precision the pair loads in chosen (``"auto"`` replaced),
    once, so that the run's config records it as it ran."""
    from marspec.devices import resolve_device
    from marspec.precision import choose_precision

    precision = choose_precision(
        target, load_settings.target_quant, dtype, resolve_device(load_settings.device)
    )
    return replace(load_settings, target_quant=precision.target_quant), str(precision.dtype)


def _check_task(task: str, limit: int | None) -> None:
    """Refuse an unknown task or an empty slice of it, before anything loads."""
    from marspec.eval.datasets import TASKS

    if task not in TASKS:
        raise MarspecError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    if limit is not None and limit < 1:
        raise MarspecError(f"--limit must be >= 1, got {limit}")


def _settled_methods(
    method_spec: str,
    pair: Pair,
    theta: str | None,
    margin: str | None,
    k: int,
    new_tokens: int,
    temperature: float,
    tree: str | None,
) -> tuple[DecodeConfig, list[Method]]:
    """The run's MARS setting, settled as the library settles it (theta="auto" from the pair's
    calibration, unset values the measured default for this run's temperature), kept in config.json as
    settled; and the methods, whose own rules are settled apart (marspec.eval.methods)."""
    from marspec.eval.methods import parse_methods
    from marspec.rules import parse_theta
    from marspec.settings import GenerationOptions, settle

    options = GenerationOptions(
        rule="mars",
        theta=parse_theta(theta),
        margin=margin,
        k=k,
        max_new_tokens=new_tokens,
        temperature=temperature,
        tree=tree,
    )
    run = settle(options, pair)
    auto = None
    if "@auto" in method_spec:
        auto = settle(GenerationOptions(rule="mars", theta="auto", temperature=temperature), pair).rule
    assert isinstance(run.rule.theta, float)
    methods = parse_methods(method_spec, run.rule.theta, auto, run.rule.margin)
    if run.tree is not None and not any(m.tree for m in methods):
        raise MarspecError("--tree is set but no method drafts a tree: add e.g. mars+tree to --methods")
    if run.tree is None and any(m.tree for m in methods):
        raise MarspecError("a +tree method needs a tree shape: pass --tree, e.g. --tree 2,2")
    return run, methods


def _bench_config(
    *,
    task: str,
    methods: list[Method],
    run: DecodeConfig,
    k: int,
    new_tokens: int,
    target: str,
    draft: str | None,
    dtype: str,
    load_settings: LoadSettings,
    sampling: SamplingSettings,
    prefix_reuse: bool,
) -> BenchConfig:
    """What the run records in config.json; ``draft`` is None when no method drafts with a model (its
    drafting settings are then recorded as absent). Reads torch's thread count, set by then."""
    import torch

    from marspec.backends.fixed import graphs_plan
    from marspec.devices import resolve_device
    from marspec.eval.bench import BenchConfig

    device = resolve_device(load_settings.device)
    return BenchConfig(
        task=task,
        methods=tuple(m.name for m in methods),
        theta=run.rule.theta,
        margin=run.rule.margin,
        k=k,
        max_new_tokens=new_tokens,
        target=target,
        draft=draft if draft is not None else "none",
        draft_quant=load_settings.draft_quant if draft is not None else "none",
        draft_confidence=load_settings.draft_confidence if draft is not None else 0.0,
        lookup=load_settings.lookup if draft is not None else False,
        dtype=dtype,
        threads=torch.get_num_threads(),
        tree=",".join(map(str, run.tree)) if run.tree else None,
        prepack=load_settings.prepack,
        target_quant=load_settings.target_quant,
        device=str(device),
        graphs="on" if graphs_plan(load_settings.graphs, device)[0] else "off",
        temperature=sampling.temperature,
        samples=sampling.samples,
        plain_limit=sampling.plain_limit,
        prefix_reuse=prefix_reuse,
    )


def _run_with_progress(
    decoder: Decoder,
    questions: list[Question],
    methods: list[Method],
    config: BenchConfig,
    out: Path,
    console: Console | None,
    redo_contended: bool,
    redo_other_cpu: bool,
    redo_apart: bool,
) -> dict[str, Any]:
    """Run (or resume) the benchmark, showing each decode's progress on ``console``."""
    from marspec.eval.bench import planned_runs
    from marspec.eval.grading import grader_for
    from marspec.eval.runner import run_bench

    with _progress(console, config.task, planned_runs(questions, methods, config)) as advance:

        def done(question, method, sample: int, skipped: bool) -> None:
            which = f" sample {sample}" if config.samples > 1 else ""
            advance(f"{question.qid}{which} {method.name}", skipped=skipped)

        return run_bench(
            decoder,
            questions,
            methods,
            config,
            out,
            grader_for(config.task),
            done,
            redo_contended,
            redo_other_cpu,
            redo_apart,
        )


def _status(console: Console | None, message: str) -> Any:
    from marspec.progress import status

    return nullcontext() if console is None else status(console, message)


@contextmanager
def _progress(console: Console | None, title: str, total: int) -> Iterator[Advance]:
    if console is None:
        yield lambda description, skipped=False: None
        return
    from marspec.progress import progress

    with progress(console, title, total, eta=True) as advance:
        yield advance
