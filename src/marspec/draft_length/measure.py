"""What the draft-length choice measures on a loaded pair: its forward costs and its draft's acceptance.

Costs: the target's forward over 1 .. 16 rows and the draft's one-token forward, on a cache of
:data:`CONTEXT` tokens of the calibration text rolled back after each call, as the decode loop does: the
target scores the text's next tokens, the draft drafts (each token fed its own greedy choice before, as a
draft runs). Real text and the draft's own choices, not random ids: a Q4_K draft's output layer scores all
of its ids only where the draft is unsure (:mod:`marspec.backends.draft_head`), which on random ids, or
on text it did not write, is more often than where it drafts. The calls go in rounds, each round every
size in turn (after a round of warm-up), and each size keeps the median of its rounds: a slow stretch of a
shared machine then falls on all sizes alike instead of on a few, whose costs would bend the choice.

Acceptance: the calibration prompts (:mod:`marspec.draft_length.calibration_text`) are decoded once by
strict speculative decoding, which gives the target's own greedy continuation; the draft then reads
each prompt and its continuation in one forward. At every position of the continuation that gives the
draft's token and its probability (its confidence) where the draft saw the target's text, which is what
a draft sees up to and including its first rejected token, and whether the target chose the same token
(greedy acceptance). :class:`~marspec.draft_length.cost_model.Acceptance` turns these into rates at each
confidence stop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from marspec.decode import decode
from marspec.devices import synchronize
from marspec.drafters.model import ModelDrafter
from marspec.interfaces import CausalLM
from marspec.settings import GenerationOptions, settle
from marspec.stats import GenerationStats
from marspec.verify.top_tokens import argmax

MAX_ROWS = 16  # the longest verification measured: drafts of up to 15 tokens
DRAFT_RUN = 4  # draft tokens a timed draft call runs, each fed the one before (its cost: the run's / 4)
CONTEXT = 128  # cached tokens under each timed forward, about a demo prompt and part of its answer
# Timed rounds (each size's median is kept), after one round of warm-up: a round costs ~1.5 s on the
# default pair; with 3, three measurements of the same AVX-512 kernels on a quiet 2-core Zen 4 put the
# one-row cost, the choice's unit, at 33.8, 43.3 and 48.2 ms (and k at 4 or 5).
REPEATS = 7
NEW_TOKENS = 64  # the continuation decoded after each calibration prompt
ROWS_AT_ONCE = 16  # the draft's rows scored in one forward when its confidences are read


@dataclass(frozen=True)
class Measured:
    """A pair's costs (seconds) and its draft's record on the calibration text."""

    target_s: dict[int, float]  # a target forward by the rows it scores
    draft_s: float  # a draft forward over one token
    confidences: list[float]  # per continuation position: the draft's probability of its own token
    accepted: list[bool]  # ... and whether it was the target's token


@torch.inference_mode()
def measure_costs(target: CausalLM, draft: CausalLM, text: torch.Tensor) -> tuple[dict[int, float], float]:
    """The target's forward at 1 .. :data:`MAX_ROWS` rows and the draft's at one token, in seconds
    (the median of :data:`REPEATS` rounds), after :data:`CONTEXT` tokens of ``text`` (token ids, repeated
    where shorter); both caches are left empty. The target scores the text's next tokens; the draft
    drafts as it does in decoding, :data:`DRAFT_RUN` tokens each fed its own greedy choice before."""
    ids = text.flatten().repeat(-(-(CONTEXT + MAX_ROWS) // max(text.numel(), 1)))[: CONTEXT + MAX_ROWS]
    for lm in (target, draft):
        lm.reset()
        lm.forward(ids[:CONTEXT].to(lm.device), last_only=True)

    def draft_run() -> None:
        token = ids[CONTEXT : CONTEXT + 1].to(draft.device)
        for _ in range(DRAFT_RUN):
            token = argmax(draft.forward(token)[-1]).view(1)

    calls: list[tuple[CausalLM, Callable[[], object]]] = [
        (target, lambda n=n: target.forward(ids[CONTEXT : CONTEXT + n].to(target.device)))
        for n in range(1, MAX_ROWS + 1)
    ]
    calls.append((draft, draft_run))
    samples: list[list[float]] = [[] for _ in calls]
    for round_ in range(REPEATS + 1):  # round 0 warms every size up and is dropped
        for (lm, call), times in zip(calls, samples, strict=True):
            synchronize(lm.device)
            start = time.perf_counter()
            call()
            synchronize(lm.device)
            if round_:
                times.append(time.perf_counter() - start)
            lm.rollback(CONTEXT)
    target.reset()
    draft.reset()
    medians = [statistics.median(times) for times in samples]
    return dict(zip(range(1, MAX_ROWS + 1), medians[:-1], strict=True)), medians[-1] / DRAFT_RUN


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
        if len(prompt) > 1:
            lm.forward(ids[: len(prompt) - 1], last_only=True)  # the prompt's cache; its rows predict nothing
        # The rows that predict the continuation, a few at a time: a row's logits are the vocabulary wide
        # (0.6 MB on the default pair), so all of them at once would raise the load's peak memory.
        for start in range(len(prompt) - 1, len(ids) - 1, ROWS_AT_ONCE):
            end = min(start + ROWS_AT_ONCE, len(ids) - 1)
            confidence, guess = torch.softmax(lm.forward(ids[start:end]).float(), dim=-1).max(dim=-1)
            confidences += confidence.tolist()
            accepted += (guess == ids[start + 1 : end + 1]).tolist()
    target.reset()
    drafter.reset()
    return confidences, accepted
