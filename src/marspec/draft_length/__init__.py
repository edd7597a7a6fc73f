"""The draft length ``k`` and confidence stop a pair decodes with by default, from this machine's costs.

How long a draft should run depends on what verifying it costs against a draft step, and that differs
from one processor and engine to the next (a 13-row verification of the q4k target costs about two
one-token steps on AMD Zen 5, about four on Zen 4). So the first time a pair is loaded on a CPU with a
draft model, marspec measures its costs and its draft's acceptance on a short built-in text
(:mod:`~marspec.draft_length.measure`, some 10 to 30 seconds), keeps them in the model cache for this
processor, thread count and engine (:mod:`~marspec.draft_length.store`), and chooses the ``k`` and stop
with the most expected tokens per second (:mod:`~marspec.draft_length.cost_model`). Later loads read the
measurements back.

A ``k`` the user names for a generation wins. A stop named when the pair loads means the user tunes the
draft: nothing is measured, and ``k`` is the default unless named (the self-test's pairs, ``marspec
bench`` and ``calibrate`` name theirs, so they never measure).
``MARSPEC_DRAFT_COSTS=again`` measures anew (the machine changed, or other work held its cores the
first time); ``MARSPEC_DRAFT_COSTS=off`` skips the measurement: the pair then drafts with the fixed
defaults of :mod:`marspec.defaults` (k 8, stop 0.55), as it does with an n-gram drafter or an EAGLE-3
head, and on another device than the CPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from marspec.defaults import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K
from marspec.draft_length import store
from marspec.draft_length.cost_model import STOPS, Acceptance, Costs, Prediction, choose, rising
from marspec.draft_length.measure import Measured, draft_record, measure_costs
from marspec.draft_length.store import PairKey
from marspec.drafters.model import ModelDrafter
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM

ENV = "MARSPEC_DRAFT_COSTS"
FIXED = f"k {DEFAULT_K}, stop {DEFAULT_DRAFT_CONFIDENCE:g}"  # what a pair drafts with when nothing is chosen
VERIFY_ROWS_SHOWN = 13  # the verification the explanation quotes (a k = 12 draft), as issue 79 does

__all__ = [
    "ENV",
    "DraftChoice",
    "PairKey",
    "busy_note",
    "decide",
    "draft_choice",
    "measuring_allowed",
    "stored_choices",
]


def _switch() -> Literal["on", "off", "again"]:
    """``$MARSPEC_DRAFT_COSTS``: unset or ``on`` measures once and reads the measurements back after,
    ``off`` never measures, ``again`` measures at every load and replaces what was stored (after the
    machine changed, or when the first measurement ran while other work held the cores)."""
    value = os.environ.get(ENV, "on").strip().lower()
    if value in ("on", "1", "true", "yes", ""):
        return "on"
    if value in ("off", "0", "false", "no"):
        return "off"
    if value == "again":
        return "again"
    raise MarspecError(
        f"{ENV}={value!r} is not understood: set it to 'off' (the fixed {FIXED}), 'on' or 'again' "
        "(measure anew)"
    )


def measuring_allowed() -> bool:
    """Whether ``$MARSPEC_DRAFT_COSTS`` lets a load choose the draft length from measured costs."""
    return _switch() != "off"


@dataclass(frozen=True)
class DraftChoice:
    """The draft length and stop chosen for a pair, with what they were chosen from."""

    k: int
    stop: float
    prediction: Prediction
    costs: Costs
    acceptance: Acceptance  # at the chosen stop
    source: Literal["measured", "cached"]

    @property
    def plain_tokens_per_s(self) -> float:
        return 1 / self.costs.verify(1)

    def explain(self) -> str:
        """Two lines: the choice and its expected speed, then the costs it came from."""
        c, a, p = self.costs, self.acceptance, self.prediction
        rows = min(VERIFY_ROWS_SHOWN, max(c.target))
        step_ms = 1000 * c.verify(1)
        return (
            f"k={self.k}, stop {self.stop:g}: expected {p.tokens_per_s:.1f} tok/s, "
            f"{p.tokens_per_s / self.plain_tokens_per_s:.2f}x plain ({p.tokens_per_step:.2f} tokens "
            f"per step)\nfrom this machine's costs ({self.source}): target step {step_ms:.1f} ms, "
            f"{rows}-row verification {1000 * c.verify(rows):.1f} ms ({c.verify(rows) / c.verify(1):.1f} "
            f"steps), draft step {1000 * c.draft:.1f} ms; draft tokens accepted {a.alpha:.0%} on the "
            f"calibration text, {a.sure:.0%} of them at or above the stop"
        )


def decide(measured: Measured, source: str = "measured") -> DraftChoice:
    """The choice ``measured`` leads to: the best k, and the best stop of :data:`STOPS`, on the
    target's costs made to rise with rows (:func:`~marspec.draft_length.cost_model.rising`)."""
    costs = Costs(rising(measured.target_s), measured.draft_s)
    table = {s: Acceptance.measured(s, measured.confidences, measured.accepted) for s in STOPS}
    best = choose(costs, table.values())
    return DraftChoice(best.k, best.stop, best, costs, table[best.stop], source)  # type: ignore[arg-type]


def draft_choice(
    key: PairKey,
    target: CausalLM,
    drafter: ModelDrafter,
    prompts: Callable[[], Sequence[torch.Tensor]],
    eos_token_ids: frozenset[int],
    announce: Callable[[str], None] | None = None,
) -> DraftChoice:
    """The pair's choice: from its stored measurements, else measured now (``prompts`` gives the
    calibration prompts' ids) and stored. ``announce`` receives a line before a measurement starts."""
    measured = None if _switch() == "again" else store.load(key)
    if measured is not None:
        return decide(measured, "cached")
    if announce is not None:
        announce(
            f"measuring {key.target} ({key.target_weights}) and {key.draft} ({key.draft_weights}) on this "
            f"CPU to choose the draft length, once ({ENV}=off skips it, =again measures anew)"
        )
    start = time.perf_counter()
    calibration = list(prompts())
    target_s, draft_s = measure_costs(target, drafter.draft_model, torch.cat(calibration))
    confidences, accepted = draft_record(target, drafter, calibration, eos_token_ids)
    if not confidences:
        raise MarspecError("the draft-length calibration produced no tokens: set MARSPEC_DRAFT_COSTS=off")
    measured = Measured(target_s, draft_s, confidences, accepted)
    store.save(key, measured)
    choice = decide(measured, "measured")
    if announce is not None:
        announce(f"measured in {time.perf_counter() - start:.0f} s: {choice.explain()}{busy_note()}")
    return choice


def busy_note() -> str:
    """A warning when other work held the cores during a measurement (a load average above the core
    count, where its timings measure the load more than the pair), or nothing."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores:
        return ""
    return (
        f"\nthe machine was busy while measuring (load {load:.1f} on {cores} cores): run again with "
        f"{ENV}=again when it is quiet"
    )


def stored_choices(cpu: str) -> str:
    """What each pair measured on the processor ``cpu`` drafts with, and why, one pair after another (the
    self-test's report); or why nothing is measured."""
    if not measuring_allowed():
        return f"{ENV}=off: every pair drafts with {FIXED}"
    found = store.stored_on(cpu)
    if not found:
        return (
            "not measured on this CPU yet: a pair with a draft model and no stop named measures its costs "
            f"the first time it loads here ({ENV}=off keeps {FIXED})"
        )
    return "\n".join(
        f"{key.target} ({key.target_weights}) + {key.draft} ({key.draft_weights}), "
        f"{key.threads} thread{'s' if key.threads != 1 else ''}, {key.kernels} kernels: "
        + decide(measured, source="cached").explain()
        for key, measured in found
    )
