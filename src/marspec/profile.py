"""Forward costs by number of scored tokens, and the ideal time of a decode they imply.

Speculative decoding's limit on a machine is set by two curves: what one target forward costs as a
function of how many tokens it scores (verification), and what one draft forward costs. With them, a
run's recorded steps give its ideal time (every step's verification plus every draft forward, nothing
else), and achieved/ideal says how much the loop itself, cache growth and the machine's drift add.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from marspec.devices import synchronize
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM


@dataclass
class ForwardCosts:
    """Median seconds of one forward, keyed by the number of tokens it scores, after ``context`` cached
    positions. ``draft`` is empty when there is no draft model."""

    context: int
    target: dict[int, float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)

    def target_s(self, n: int) -> float:
        return _lookup(self.target, n)

    def draft_s(self, n: int = 1) -> float:
        return _lookup(self.draft, n) if self.draft else 0.0

    def to_dict(self) -> dict:
        return {"context": self.context, "target": self.target, "draft": self.draft}

    @classmethod
    def from_dict(cls, data: Mapping) -> ForwardCosts:
        return cls(int(data["context"]), _by_size(data["target"]), _by_size(data.get("draft", {})))


def _by_size(costs: Mapping) -> dict[int, float]:
    return {int(n): float(s) for n, s in costs.items()}  # JSON turned the sizes into strings


def _lookup(costs: dict[int, float], n: int) -> float:
    """Cost at ``n`` tokens: measured, else linear between the nearest measured sizes (or the end slope)."""
    if n in costs:
        return costs[n]
    sizes = sorted(costs)
    below = [s for s in sizes if s < n] or sizes[:1]
    above = [s for s in sizes if s > n] or sizes[-1:]
    lo, hi = below[-1], above[0]
    if lo == hi:
        lo, hi = (sizes[-2], sizes[-1]) if len(sizes) > 1 else (lo, lo)
    if lo == hi:
        return costs[lo] * n / lo
    return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


@torch.inference_mode()
def measure(lm: CausalLM, sizes: Iterable[int], context: int = 256, repeats: int = 5) -> dict[int, float]:
    """Median wall seconds of ``lm.forward`` over n new tokens, for each n in ``sizes``, on top of a cache
    of ``context`` random tokens (rolled back after each forward, as the decode loop does). The device is
    synchronised before and after each timed forward: on a GPU the wall time then holds its kernels, not
    only their launch (the loop waits for a forward's result, so that is what a step pays)."""
    gen = torch.Generator().manual_seed(0)
    vocab = lm.vocab_size
    lm.reset()
    lm.forward(torch.randint(vocab, (context,), generator=gen).to(lm.device), last_only=True)
    out: dict[int, float] = {}
    for n in sizes:
        samples = []
        for _ in range(repeats + 1):  # the first forward at a new size warms kernels up: dropped
            tokens = torch.randint(vocab, (n,), generator=gen).to(lm.device)
            synchronize(lm.device)
            start = time.perf_counter()
            lm.forward(tokens)
            synchronize(lm.device)
            samples.append(time.perf_counter() - start)
            lm.rollback(context)
        out[n] = statistics.median(samples[1:])
    lm.reset()
    return out


def profile_pair(
    target: CausalLM, draft: CausalLM | None, max_tokens: int, context: int = 256, repeats: int = 5
) -> ForwardCosts:
    """Target costs for 1..max_tokens scored tokens; draft costs for 1 and 2 (a proposal's first forward
    also feeds the token the target just emitted, sometimes one more)."""
    costs = ForwardCosts(context)
    costs.target = measure(target, range(1, max_tokens + 1), context, repeats)
    if draft is not None:
        if not isinstance(draft, CausalLM):  # an EAGLE-3 head cannot forward without the target's states
            raise MarspecError(
                f"the forward-cost profile measures draft models, and {draft.name!r} is an EAGLE-3 head, "
                "which it does not measure yet: profile with a draft model, or read the head's cost from "
                "the run's draft seconds (stats.draft_forward_s)"
            )
        costs.draft = measure(draft, (1, 2), context, repeats)
    return costs


def ideal_seconds(verify_sizes: Mapping[int | str, int], draft_forwards: int, costs: ForwardCosts) -> float:
    """The time a run's forwards would take at the profiled costs: each verification at its size, each
    draft forward at one token. Prefill is left out (it is the same for every method)."""
    return verify_seconds(verify_sizes, costs) + draft_forwards * costs.draft_s(1)


def verify_seconds(verify_sizes: Mapping[int | str, int], costs: ForwardCosts) -> float:
    """The time a run's verification forwards would take at the profiled costs (count by size)."""
    return sum(count * costs.target_s(int(n)) for n, count in verify_sizes.items())
