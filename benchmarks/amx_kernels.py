r"""The Q4_K and Q6_K kernels' AMX path against their VNNI path, interleaved in one process, on the
default pair's real layers: first each kind of layer of the target alone at 1-32 rows; then the target's
and the draft's forwards at 1-16 rows (the 200-token context of a decode step); then, for each of
``--clients``, that many clients decoding the demo's prompts through the batch scheduler (no HTTP),
AMX off (every call on VNNI) and on (its default: calls of 8 rows or more) in alternating rounds.
Both paths give the same bits (tests/test_q4k.py, tests/test_q6k.py); only time differs.

    python benchmarks/amx_kernels.py --clients 1 4 --rounds 4 --out amx-kernels.json

A timing: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import add_scheduler_ab_args, git_commit, machine, scheduler_ab, script_parser, write_json

from marspec.backends import kernels
from marspec.backends.kernels import amx_available, amx_from_rows
from marspec.backends.q4k import Q4KLinear
from marspec.backends.q6k import Q6KLinear

# The rows from which the Q4_K and Q6_K kernels' calls take AMX: never, and the kernels' defaults.
ARMS = {"vnni": (0, 0), "amx": (8, 8)}


def interleaved(call: Callable[[], object], rounds: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of ``call`` under each arm, the arms alternating within each round."""
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(rounds):
        for arm in list(ARMS) if round_ % 2 == 0 else list(ARMS)[::-1]:
            with amx_from_rows(*ARMS[arm]):
                call()
                for _ in range(repeats):
                    start = time.perf_counter()
                    call()
                    samples[arm].append(time.perf_counter() - start)
    return {arm: statistics.median(values) * 1e3 for arm, values in samples.items()}


def layers(target: torch.nn.Module, rows_list: list[int]) -> list[dict[str, Any]]:
    """One layer of each kind (type and shape) in the target, alone."""
    kinds: dict[tuple[str, int, int], torch.nn.Module] = {}
    for module in target.modules():
        if isinstance(module, Q4KLinear | Q6KLinear):
            kinds.setdefault((type(module).__name__, module.out_features, module.in_features), module)
    table = []
    for (kind, n, k), layer in sorted(kinds.items()):
        for rows in rows_list:
            x = torch.randn(rows, k)
            ms = interleaved(lambda layer=layer, x=x: layer(x), rounds=6, repeats=5)
            table.append({"layer": f"{kind} {n}x{k}", "rows": rows, **ms, "vnni/amx": ms["vnni"] / ms["amx"]})
            print(table[-1], flush=True)
    return table


def forwards(models: dict[str, Any], rows_list: list[int]) -> list[dict[str, Any]]:
    """Each model's forward of ``rows`` new tokens after a 200-token context (rolled back after each)."""
    context = torch.randint(100, 5000, (232,))
    table = []
    for name, lm in models.items():
        lm.reset()
        lm.forward(context[:200], last_only=True)
        for rows in rows_list:

            def step(lm: Any = lm, rows: int = rows) -> None:
                lm.forward(context[200 : 200 + rows])
                lm.rollback(200)

            ms = interleaved(step, rounds=6, repeats=3)
            table.append({"model": name, "rows": rows, **ms, "vnni/amx": ms["vnni"] / ms["amx"]})
            print(table[-1], flush=True)
    return table


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4], help="scheduler A/B client counts")
    add_scheduler_ab_args(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not amx_available():
        raise SystemExit("no AMX path here: it needs an AMX int8 CPU (and the kernels' library)")
    import marspec

    torch.set_num_threads(2)
    decoder = marspec.Decoder(threads=2)
    models = {"target": decoder.target, "draft": decoder.drafter.draft_model}
    result: dict[str, Any] = {
        "commit": git_commit(),
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    result["layers_ms"] = layers(decoder.target.model, [1, 4, 6, 8, 12, 16, 32])
    result["forwards_ms"] = forwards(models, [1, 4, 6, 8, 12, 16])
    del decoder, models
    result["batch"] = []
    for clients in args.clients:

        def arm(rows: tuple[int, int]) -> Callable[[], None]:
            return lambda: kernels.ops().amx_set_min_rows(*rows)

        arms = {name: arm(rows) for name, rows in ARMS.items()}
        ab = scheduler_ab(arms, clients, args.rounds, args.max_new_tokens)
        kernels.ops().amx_set_min_rows(*ARMS["amx"])
        medians = ab["medians"]
        ab["amx/vnni tok/s"] = medians["amx"]["tok_s"] / medians["vnni"]["tok_s"]
        print(clients, "clients:", {a: {k: round(v, 2) for k, v in m.items()} for a, m in medians.items()})
        print(f"  amx/vnni {ab['amx/vnni tok/s']:.3f}x, one answer per prompt: {ab['one_answer_per_prompt']}")
        result["batch"].append(ab)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
