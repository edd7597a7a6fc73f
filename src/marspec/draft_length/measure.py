"""What the draft-length choice measures on a loaded pair: its forward costs and its draft's acceptance.

Costs: the target's forward over 1 .. 16 rows and the draft's one-token forward, each the median of a
few calls after a warm-up, on a cache of :data:`CONTEXT` tokens (:func:`marspec.profile.profile_pair`).

Acceptance: the calibration prompts (:mod:`marspec.draft_length.calibration_text`) are decoded once by
strict speculative decoding, which gives the target's own greedy continuation; the draft then reads
each prompt and its continuation in one forward. At every position of the continuation that gives the
draft's token and its probability (its confidence) where the draft saw the target's text, which is what
a draft sees up to and including its first rejected token, and whether the target chose the same token
(greedy acceptance). :class:`~marspec.draft_length.cost_model.Acceptance` turns these into rates at each
confidence stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from marspec.decode import decode
from marspec.drafters.model import ModelDrafter
from marspec.interfaces import CausalLM
from marspec.profile import profile_pair
from marspec.settings import GenerationOptions, settle
from marspec.stats import GenerationStats

MAX_ROWS = 16  # the longest verification measured: drafts of up to 15 tokens
CONTEXT = 128  # cached tokens under each timed forward, about a demo prompt and part of its answer
REPEATS = 3  # timed calls per size (the median is kept), after one warm-up call
NEW_TOKENS = 64  # the continuation decoded after each calibration prompt


@dataclass(frozen=True)
class Measured:
    """A pair's costs (seconds) and its draft's record on the calibration text."""

    target_s: dict[int, float]  # a target forward by the rows it scores
    draft_s: float  # a draft forward over one token
    confidences: list[float]  # per continuation position: the draft's probability of its own token
    accepted: list[bool]  # ... and whether it was the target's token


def measure_costs(target: CausalLM, draft: CausalLM) -> tuple[dict[int, float], float]:
    """The target's forward at 1 .. :data:`MAX_ROWS` rows and the draft's at one token, in seconds."""
    costs = profile_pair(target, draft, MAX_ROWS, context=CONTEXT, repeats=REPEATS)
    return costs.target, costs.draft_s(1)


@torch.inference_mode()
def draft_record(
    target: CausalLM,
    drafter: ModelDrafter,
    prompts: Sequence[torch.Tensor],
    eos_token_ids: frozenset[int],
) -> tuple[list[float], list[bool]]:
    """Each continuation position's draft confidence and greedy acceptance over ``prompts`` (token ids
    on the target's device); both caches are left empty."""
    config = replace(
        settle(GenerationOptions(rule="strict", k=8, max_new_tokens=NEW_TOKENS)), eos_token_ids=eos_token_ids
    )
    confidences: list[float] = []
    accepted: list[bool] = []
    lm = drafter.draft_model
    for prompt in prompts:
        continuation = [
            t for step in decode(target, drafter, prompt, config, GenerationStats()) for t in step.tokens
        ]
        if not continuation:
            continue
        ids = torch.cat([prompt, torch.tensor(continuation, device=prompt.device)])
        lm.reset()
        logits = lm.forward(ids[:-1])[len(prompt) - 1 :].float()  # the rows that predict the continuation
        probs = torch.softmax(logits, dim=-1)
        confidence, guess = probs.max(dim=-1)
        confidences += confidence.tolist()
        accepted += (guess == ids[len(prompt) :]).tolist()
    target.reset()
    drafter.reset()
    return confidences, accepted
