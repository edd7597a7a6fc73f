"""Commands that generate: ``generate``, ``demo``; and ``models``, which prepares them."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from marspec.cli.common import LoadSettings, app, err, load_decoder, user_errors
from marspec.cli.options import (
    ChosenDraftConfidenceOpt,
    ChosenKOpt,
    DeviceOpt,
    DraftOpt,
    DraftQuantOpt,
    DtypeOpt,
    GraphsOpt,
    LookupOpt,
    MarginOpt,
    PrepackOpt,
    TargetOpt,
    TargetQuantOpt,
    ThetaOpt,
    ThreadsOpt,
    TreeOpt,
)
from marspec.defaults import (
    DEFAULT_DRAFT_QUANT,
    DEFAULT_DTYPE,
    DEFAULT_LOOKUP,
    DEFAULT_PREPACK,
    DEFAULT_RULE,
    DEFAULT_TARGET_QUANT,
)
from marspec.errors import MarspecError
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS
from marspec.progress import progress
from marspec.rules import AUTO, LOSSLESS_RULES, RIVALS, parse_theta, uses_drafter
from marspec.settings import GenerationOptions, calibration_of, decoding_temperature, settle_rule

if TYPE_CHECKING:
    from marspec.api import Decoder, GenerationResult
    from marspec.demo import MethodSummary


RuleOpt = Annotated[
    str | None,
    typer.Option(
        "--rule",
        help=f"{' | '.join(LOSSLESS_RULES)} | mars; rivals: {' | '.join(RIVALS)} (--theta). "
        f"Default: {DEFAULT_RULE} (lossless: the target's own output); --rule mars relaxes near-ties "
        "(faster, and it may change answers).",
        show_default=False,
    ),
]


@app.command()
def generate(
    prompt: Annotated[
        str, typer.Argument(help="The prompt (a chat template is applied for instruct models).")
    ],
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    draft_confidence: ChosenDraftConfidenceOpt = None,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    graphs: GraphsOpt = "auto",
    rule: RuleOpt = None,
    theta: ThetaOpt = None,
    margin: MarginOpt = None,
    k: ChosenKOpt = None,
    adaptive_k: Annotated[
        bool, typer.Option("--adaptive-k", help="Grow/shrink the draft length with acceptance (max --k).")
    ] = False,
    tree: TreeOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Upper bound on new tokens.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")] = 0.0,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object.")] = False,
) -> None:
    """Generate text for PROMPT, streaming it (or printing one JSON object with --json)."""
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
        _check_calibrated(options, target, draft, target_quant, dtype, device)
        decoder = load_decoder(
            target,
            draft if uses_drafter(options.rule) else None,
            dtype,
            threads,
            LoadSettings(draft_quant, draft_confidence, lookup, prepack, device, target_quant, graphs),
        )
        _generate_and_print(decoder, prompt, options, as_json)


def _check_calibrated(
    options: GenerationOptions, target: str, draft: str, target_quant: str, dtype: str, device: str
) -> None:
    """``--theta auto`` without a stored calibration of the pair (its target in the precision it will
    load in) is refused here, before the weights load."""
    if options.theta != AUTO or draft in (None, "none"):
        return
    from marspec.devices import resolve_device
    from marspec.precision import choose_precision

    target_quant = choose_precision(target, target_quant, dtype, resolve_device(device)).target_quant
    settle_rule(
        options.rule,
        options.theta,
        options.margin,
        temperature=decoding_temperature(options.temperature),
        calibrated=calibration_of(target, draft, target_quant),
    )


def _generate_and_print(decoder: Decoder, prompt: str, options: GenerationOptions, as_json: bool) -> None:
    """One JSON object on stdout with --json; else the text streamed to stdout and its statistics on
    stderr."""
    opts = asdict(options)
    if as_json:
        result = decoder.generate(prompt, **opts)
        print(json.dumps(result.to_dict()))
        return
    result = decoder.generate(prompt, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()), **opts)
    sys.stdout.write("\n")
    s = result.stats
    err.print(
        f"{s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.2f} tok/s), tau {s.tau:.2f}, "
        f"accepted {s.accepted_exact} exact + {s.accepted_relaxed} relaxed, {s.rejected} rejections, "
        f"overhead {s.overhead_s * 1000:.0f} ms, finish: {result.finish_reason}",
        style="dim",
    )


@app.command()
def demo(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    draft_quant: DraftQuantOpt = DEFAULT_DRAFT_QUANT,
    target_quant: TargetQuantOpt = DEFAULT_TARGET_QUANT,
    draft_confidence: ChosenDraftConfidenceOpt = None,
    lookup: LookupOpt = DEFAULT_LOOKUP,
    prepack: PrepackOpt = DEFAULT_PREPACK,
    device: DeviceOpt = "auto",
    graphs: GraphsOpt = "auto",
    theta: ThetaOpt = None,
    k: ChosenKOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="New tokens per prompt.")] = 128,
    dtype: DtypeOpt = DEFAULT_DTYPE,
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Also print the summary as JSON.")] = False,
) -> None:
    """Plain vs strict speculative vs MARS decoding side by side on built-in prompts (code, math, chat)."""
    with user_errors():
        theta_value = parse_theta(theta)
        # Fail fast, before loading: theta is MARS's (the demo's strict and plain rows ignore it).
        GenerationOptions(rule="mars", theta=theta_value, k=k, max_new_tokens=max_new_tokens)
        if draft in ("none",):
            raise MarspecError(
                "the demo compares speculative methods: give a drafter with --draft NAME|ngram"
            )
        decoder = load_decoder(
            target,
            draft,
            dtype,
            threads,
            LoadSettings(draft_quant, draft_confidence, lookup, prepack, device, target_quant, graphs),
        )
        mars = decoder.settle(GenerationOptions(rule="mars", theta=theta_value, k=k))  # auto: calibrated?
        err.print(draft_length_note(decoder, k), highlight=False)
        summaries = _run_demo(decoder, k, theta_value, max_new_tokens)

    title = (
        f"marspec demo: target {target} ({decoder.target_weights}), draft {draft} "
        f"({decoder.draft_weights}), k={mars.k}{_stop_shown(decoder)}, {mars.rule.margin} "
        f"theta={mars.rule.theta:g}, "
        f"{len(summaries[0].results)} prompts x {max_new_tokens} new tokens"
    )
    Console().print(_demo_table(summaries, title))
    err.print(
        "lossless: the target's own greedy output. relaxed: accepted draft tokens that were the target's "
        "runner-up at a near-tie (mars only: faster, and it can change answers, see docs/results.md). "
        "= plain: prompts whose output equals plain decoding's."
    )
    if as_json:
        print(json.dumps(_demo_json(summaries)))


def draft_length_note(decoder: Decoder, k: int | None) -> str:
    """What the pair drafts with and why: the choice made from this machine's costs, in two lines, or
    why the fixed defaults apply."""
    choice = decoder.draft_choice
    if choice is None:
        settled = decoder.settle(GenerationOptions(k=k)).k
        return (
            f"draft length: k={settled}{_stop_shown(decoder)}, fixed (chosen from measured costs only for "
            "a draft model on the CPU with no --draft-confidence named, unless MARSPEC_DRAFT_COSTS=off)"
        )
    named = f"k={k} named; the costs favour " if k is not None else ""
    return f"draft length: {named}{choice.explain()}"


def _stop_shown(decoder: Decoder) -> str:
    stop = decoder.draft_stop
    return "" if stop is None else f", stop {stop:g}"


def _run_demo(
    decoder: Decoder, k: int | None, theta: float | str | None, max_new_tokens: int
) -> list[MethodSummary]:
    """Every built-in prompt through every method, with a progress bar on stderr."""
    from marspec.demo import DEMO_PROMPTS, METHODS, run_demo

    with progress(err, "generating", len(DEMO_PROMPTS) * len(METHODS)) as advance:

        def done(kind: str, method: str, result: GenerationResult) -> None:
            s = result.stats
            advance(f"{kind:<4} {method:<6} {s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s")

        return run_demo(decoder, k=k, theta=theta, max_new_tokens=max_new_tokens, on_result=done)


def _demo_table(summaries: list[MethodSummary], title: str) -> Table:
    """The methods side by side, plain first (the speedups' reference)."""
    plain = summaries[0]
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,  # with the two below, fits 80 columns with every header whole
        collapse_padding=True,
        pad_edge=False,
    )
    columns = ("method", "lossless", "tokens", "tok/s", "speedup", "tau", "relaxed", "overhead")
    for col in (*columns, "= plain"):
        table.add_column(col, justify="left" if col in ("method", "lossless") else "right")
    for s in summaries:
        table.add_row(
            s.name,
            "yes" if s.lossless else "no",
            str(s.tokens),
            f"{s.mean_tokens_per_s:.2f}",
            f"{s.mean_tokens_per_s / plain.mean_tokens_per_s:.2f}x",
            f"{s.tau:.2f}",
            f"{s.relaxed_share:.1%}",
            f"{s.overhead_share:.1%}",
            f"{s.same_as_plain}/{len(s.results)}",
        )
    return table


def _demo_json(summaries: list[MethodSummary]) -> list[dict[str, Any]]:
    """The table's rows as --json prints them."""
    plain = summaries[0]
    return [
        {
            "method": s.name,
            "lossless": s.lossless,
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


@app.command()
def models(
    prepare: Annotated[
        list[str] | None,
        typer.Option(
            "--prepare", help="Convert a model into the cache now, float32 weights included (repeatable)."
        ),
    ] = None,
) -> None:
    """List the known models, or convert some into the cache ahead of time."""
    from marspec.models import cache_dir, float_model_dir

    with user_errors():
        for name in prepare or []:
            path = float_model_dir(name)
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
