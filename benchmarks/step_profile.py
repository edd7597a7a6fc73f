r"""Where a decode step's time goes on the default CPU engine: the native kernels against everything else.

The default pair as ``marspec demo`` loads it (q4k target and draft from the packaged GGUFs), each case on
top of a cache of ``--context`` tokens, rolled back after every call as the decode loop does:

- ``plain step``: the target scores one token and the loop takes its argmax;
- ``verification``: the target scores ``--verify-rows`` tokens (a k = 12 draft and the token before it)
  and the loop takes each row's top two;
- ``draft step``: the draft scores one token and the drafter takes its argmax.

Each case runs ``--repeats`` rounds of one call timed without the profiler (the step's wall time) and one
under ``torch.profiler``, so that both meet the same stretch of a shared machine; medians are kept. The
native kernels are grouped by their operator's name: the linear kernels (``q4k_linear``,
``q6k_linear``), the attention kernel (``attention_rows``) and the vocabulary kernels (``vocab_*``); each
kernel's time includes what it calls (inside the native layer's operators, the kernels they call are
named to the profiler alike). The models' Llama-family layers run through the native layer, all of a
model's in one call where they can (``layers_step``; else ``layer_step``, or ``layer_pre`` and
``layer_post``: :mod:`marspec.backends.native_layer`); ``--layers`` adds each case with a native call a
layer (``per-layer``) or through the Python layer (``python``), its name marked so, for the difference,
and then each mode's wall time against the first's, calls of the modes interleaved (``paired``).
Everything else the step runs (norms, rotary, views, copies, the glue around the kernels) is "outside
the kernels": the step's wall time less the kernels' time. The profiler adds a few microseconds to every
operator, which falls on the many small ones outside the kernels, so shares are given against the
unprofiled wall time (the figure to read) and against the profiled one; the operators outside the kernels
are listed by their own (self) time.

    python benchmarks/step_profile.py --out docs/results/step-profile-2026-12-06.json
    python benchmarks/step_profile.py --layers native,per-layer,python --repeats 6
    python benchmarks/step_profile.py --model gemma-3-270m --layers native,python --repeats 6

``--model`` (a model name or GGUF) profiles that model alone, as the q4k engine runs it, instead of the
default pair: its plain step and verification.

A timing: run it alone on the machine.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json

# Which group a native kernel belongs to, by its operator's name (``marspec_<path>::q4k_linear``, or
# ``q4k_linear`` where the native layer calls it and names it to the profiler). The native layer's own
# operators (layer_pre, layer_post) are not kernels: their ATen operators count as outside the kernels.
GROUPS = {
    "q4k_linear": "linear kernels",
    "q6k_linear": "linear kernels",
    "attention_rows": "attention kernel",
    "attention_segments": "attention kernel",
    "vocab_argmax": "vocab kernels",
    "vocab_top2": "vocab kernels",
}
OUTSIDE = "outside the kernels"
# --layers: how the layers run, and how a case's name is marked where not the default way.
MODES = {"native": "", "per-layer": "a native call a layer", "python": "Python layers"}


def group_of(op: str) -> str | None:
    """The kernel group of an operator (``namespace::name`` or ``name``), or None for one outside the
    kernels."""
    return GROUPS.get(op.rpartition("::")[2])


def profile_case(call: Callable[[], object], undo: Callable[[], object], repeats: int) -> dict[str, Any]:
    """One case in ``repeats`` rounds, each an unprofiled call then a profiled one (so both meet the same
    stretch of a shared machine), ``undo`` (the rollback) after each, untimed and unprofiled: the median
    wall time of each kind of call, each kernel operator's and group's median time per call, and the
    operators outside the kernels by mean self time per call (ms)."""
    call()  # the first call at a new shape warms up: dropped
    undo()
    walls, profiled_walls, counts = [], [], []
    runs: list[dict[str, float]] = []  # per round: each kernel operator's inclusive milliseconds
    outside_ops: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        walls.append(1000 * (time.perf_counter() - start))
        undo()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            call()
            profiled_walls.append(1000 * (time.perf_counter() - start))
        undo()
        events = prof.key_averages()
        counts.append(sum(e.count for e in events))
        # Inclusive time for a kernel: what the model waits for when it calls it.
        runs.append({e.key: e.cpu_time_total / 1000 for e in events if group_of(e.key) is not None})
        for e in events:
            if group_of(e.key) is None and e.self_cpu_time_total > 0:
                op = outside_ops.setdefault(e.key, {"self_ms": 0.0, "calls": 0.0})
                op["self_ms"] += e.self_cpu_time_total / 1000 / repeats
                op["calls"] += e.count / repeats
    wall, profiled = statistics.median(walls), statistics.median(profiled_walls)
    kernels = {
        name: statistics.median(run.get(name, 0.0) for run in runs) for name in sorted(set().union(*runs))
    }
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        group = group_of(name)
        assert group is not None
        groups[group] = groups.get(group, 0.0) + ms
    in_kernels = sum(groups.values())
    return {
        "wall_ms": wall,
        "profiled_wall_ms": profiled,
        "wall_ms_rounds": walls,
        "kernel_ms": kernels,
        "group_ms": {**groups, OUTSIDE: max(wall - in_kernels, 0.0)},
        "share": {**{g: ms / wall for g, ms in groups.items()}, OUTSIDE: max(wall - in_kernels, 0.0) / wall},
        "share_profiled": {
            **{g: ms / profiled for g, ms in groups.items()},
            OUTSIDE: max(profiled - in_kernels, 0.0) / profiled,
        },
        "operators_per_call": statistics.median(counts),
        "outside_top": dict(sorted(outside_ops.items(), key=lambda kv: -kv[1]["self_ms"])[:15]),
    }


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--context", type=int, default=128, help="cached tokens before each step")
    parser.add_argument("--verify-rows", type=int, default=13, help="tokens a verification scores")
    parser.add_argument("--repeats", type=int, default=10, help="calls per case, timed and profiled")
    parser.add_argument("--layers", default="native", help="native, per-layer or python; several: a,b")
    parser.add_argument("--model", help="a model (name or GGUF) alone instead of the default pair")
    parser.add_argument("--out", help="where to write the JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.layers.split(",")
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--layers takes {', '.join(MODES)} or several of them, not {args.layers!r}")

    decoder, target, draft = load(args.model, args.threads)
    from marspec.verify.top_tokens import argmax, top2

    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(vocab, (n,), generator=gen)

    result: dict[str, Any] = {
        "machine": machine(),
        "engine": {"target": decoder.target_weights, "draft": decoder.draft_weights},
        "context": args.context,
        "repeats": args.repeats,
        "cases": {},
    }
    cases = (
        ("plain step", target, 1, lambda lm, t: argmax(lm.forward(t)[-1])),
        (
            f"verification ({args.verify_rows} rows)",
            target,
            args.verify_rows,
            lambda lm, t: top2(lm.forward(t)),
        ),
    ) + ((("draft step", draft, 1, lambda lm, t: argmax(lm.forward(t)[-1])),) if draft is not None else ())
    with torch.inference_mode():
        for (name, lm, rows, step), mode in itertools.product(cases, modes):
            use_mode(lm, mode)
            lm.reset()
            lm.forward(tokens(args.context), last_only=True)
            new = tokens(rows)
            result["cases"][name if mode == "native" else f"{name} ({MODES[mode]})"] = profile_case(
                lambda lm=lm, step=step, new=new: step(lm, new),
                lambda lm=lm: lm.rollback(args.context),
                args.repeats,
            )
            lm.reset()
            if args.out:
                write_json(args.out, result)
        if len(modes) > 1:  # each mode's time against the first's, call by call, interleaved
            result["paired"] = {}
            for name, lm, rows, step in cases:
                lm.reset()
                lm.forward(tokens(args.context), last_only=True)
                new = tokens(rows)
                result["paired"][name] = paired_ratios(
                    lm, modes, lambda lm=lm, step=step, new=new: step(lm, new), args.context, 3 * args.repeats
                )
                lm.reset()
            if args.out:
                write_json(args.out, result)
    print(table(result))
    for name, ratios in result.get("paired", {}).items():
        print(f"{name}, interleaved: " + ", ".join(f"{m} {r:.3f}x {modes[0]}" for m, r in ratios.items()))


def load(model: str | None, threads: int) -> tuple[Any, Any, Any]:
    """The Decoder, its target and its draft model (None for ``model`` alone): the demo's pair and engine
    where ``model`` is None."""
    from marspec import Decoder
    from marspec.draft_length import ENV
    from marspec.drafters import ModelDrafter

    # No draft length is used here, so none is measured.
    os.environ.setdefault(ENV, "off")
    decoder = Decoder(threads=threads) if model is None else Decoder(model, None, threads=threads)
    drafter = decoder.drafter
    if model is None and not isinstance(drafter, ModelDrafter):
        raise SystemExit(f"the default drafter is {type(drafter).__name__}, not a draft model")
    return decoder, decoder.target, drafter.draft_model if isinstance(drafter, ModelDrafter) else None


def use_mode(lm: Any, mode: str) -> None:
    """Run ``lm``'s layers as ``mode`` (one of :data:`MODES`) says."""
    if lm.direct is not None:
        lm.direct.native_layers = mode != "python"
        lm.direct.one_call = mode == "native"


def paired_ratios(
    lm: Any, modes: list[str], call: Callable[[], object], context: int, rounds: int
) -> dict[str, float]:
    """Each of ``modes`` after the first: the median over ``rounds`` of its call's wall time over the first
    mode's, the modes called in turn within each round (their order reversed every other round), so that
    each ratio compares calls a few milliseconds apart on a shared machine."""
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(rounds + 1):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            use_mode(lm, mode)
            start = time.perf_counter()
            call()
            if i > 0:  # the first round warms each mode up
                times[mode].append(time.perf_counter() - start)
            lm.rollback(context)
    use_mode(lm, modes[0])
    first = times[modes[0]]
    return {m: statistics.median(t / f for t, f in zip(times[m], first, strict=True)) for m in modes[1:]}


def table(result: dict[str, Any]) -> str:
    """The cases side by side: wall time, then each group's share of it (ms in brackets)."""
    cases = result["cases"]
    groups = ["linear kernels", "attention kernel", "vocab kernels"]
    extra = sorted({g for c in cases.values() for g in c["group_ms"]} - {*groups, OUTSIDE})
    rows = [*groups, *extra, OUTSIDE]
    lines = [
        "| | " + " | ".join(cases) + " |",
        "|---" * (len(cases) + 1) + "|",
        "| wall ms (unprofiled) | " + " | ".join(f"{c['wall_ms']:.1f}" for c in cases.values()) + " |",
        "| wall ms (profiled) | " + " | ".join(f"{c['profiled_wall_ms']:.1f}" for c in cases.values()) + " |",
        "| operator calls | " + " | ".join(f"{c['operators_per_call']:.0f}" for c in cases.values()) + " |",
    ]
    for group in rows:
        cells = [
            f"{100 * c['share'].get(group, 0.0):.1f}% ({c['group_ms'].get(group, 0.0):.1f} ms)"
            for c in cases.values()
        ]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    for name in ("q4k_linear", "q6k_linear"):  # by operator name, called alone or by the native layer
        cells = []
        for c in cases.values():
            ms = sum(t for op, t in c["kernel_ms"].items() if op.rpartition("::")[2] == name)
            cells.append(f"{100 * ms / c['wall_ms']:.1f}%")
        lines.append(f"| of which {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
