"""Random verification blocks whose every decision is certain, shared by the kernel-level tests.

Each row's target logits put the top-1 token far ahead (``TOP``) of everything but a runner-up, which
is either a close call (``CLOSE``: ratio 0.975) or far behind (``FAR``: 0.5); the draft token is the
top-1, the runner-up or a third token. So a sampled row's test ``p(d)/q(d)`` is ~1 or ~0 and its
correction token is the top-1: vLLM's random numbers and marspec's give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marspec.rules import Rule

TOP, CLOSE, FAR = 40.0, 39.0, 20.0
# Per-request rules a batch's requests pick from (None: the deployment's), for the mixed-rule tests.
REQUEST_RULES = [
    None,
    Rule("strict"),
    Rule("mars", 0.5, "prob_ratio"),
    Rule("pthresh", 0.25),
    Rule("fly", 0.3, window=1),
]


@dataclass
class Block:
    """One request's part of a batch: K draft rows plus the bonus row."""

    logits: torch.Tensor  # [K+1, V]
    drafts: torch.Tensor  # long[K]
    draft_probs: torch.Tensor  # [K, V]: the drafter's distribution q
    greedy: bool


def random_block(g: torch.Generator, k: int, vocab: int, greedy: bool, relaxes: bool) -> Block:
    """``relaxes``: the rule under test accepts close calls (only then may a sampled row hold one)."""
    logits = torch.rand(k + 1, vocab, generator=g) * 10  # [K+1, V]
    drafts = []
    for row in range(k + 1):
        first, second, third = torch.randperm(vocab, generator=g)[:3].tolist()
        choice = torch.rand((), generator=g)
        draft = first if choice < 0.6 else second if choice < 0.9 else third
        # A sampled row may be a close call only where the rule accepts it without a draw: elsewhere a
        # close runner-up would make the correction (or bonus) token a coin toss between top-1 and top-2.
        decided_by_rule = relaxes and row < k and draft != third
        close = torch.rand((), generator=g) < 0.5 and (greedy or decided_by_rule)
        logits[row, first] = TOP
        logits[row, second] = CLOSE if close else FAR
        drafts.append(draft)
    drafts_t = torch.tensor(drafts[:k], dtype=torch.long)
    # The drafter's distribution: half its mass on the draft token, so p(d)/q(d) >= 1 wherever p(d) ~ 1.
    draft_probs = torch.full((k, vocab), 0.5 / (vocab - 1))
    draft_probs[torch.arange(k), drafts_t] = 0.5
    return Block(logits, drafts_t, draft_probs, greedy)
