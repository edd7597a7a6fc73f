"""The draft length and confidence stop that decode fastest, given what a machine's forwards cost.

The standard speculative-decoding cost model (Leviathan et al., 2023): a draft of ``k`` tokens, each
accepted with probability ``alpha`` independently, yields ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per
step (the accepted prefix and the target's own next token) for ``k`` draft forwards and one target
forward over ``k + 1`` rows. Tokens per second is their ratio.

The confidence stop (:class:`~marspec.drafters.ModelDrafter`'s ``min_confidence``) ends a draft after
its first token whose draft probability is below the stop. Drafted tokens are then of two kinds, sure
(at or above the stop) and unsure, each accepted at its own rate, and the draft goes on past a token
only if that token was sure. Token ``j`` is drafted when the ``j - 1`` before it were sure (probability
``sure^(j-1)``), and counts when those were also accepted (``(sure * accept_sure)^(j-1)``) and it is
accepted itself (``alpha``). At stop 0 every token is sure and this is the standard model.

Pure functions of the measured numbers: :func:`choose` is what :mod:`marspec.draft_length` runs on the
costs it measured, :func:`drafting_pays` what a batch of sequences asks of them (whether its drafts pay
at all, :mod:`marspec.batch.scheduler`), and what tests run on stubbed ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from marspec.errors import MarspecError

# The stops a choice weighs: 0 (always draft k), and the range where the default pair's drafts' confidences
# separate accepted tokens from rejected ones.
STOPS = (0.0, 0.3, 0.4, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class Acceptance:
    """How drafted tokens fare at one confidence stop: the share of them that are sure (confidence at or
    above the stop) and the rate at which the target accepts sure and unsure ones."""

    stop: float
    sure: float
    accept_sure: float
    accept_unsure: float

    @property
    def alpha(self) -> float:
        """The acceptance rate of a drafted token, whatever its confidence."""
        return self.sure * self.accept_sure + (1 - self.sure) * self.accept_unsure

    @classmethod
    def measured(cls, stop: float, confidences: Sequence[float], accepted: Sequence[bool]) -> Acceptance:
        """The rates at ``stop`` of tokens drafted where the draft saw the target's own text: each one's
        draft probability and whether the target's greedy choice there was the same token."""
        if not confidences or len(confidences) != len(accepted):
            raise MarspecError("acceptance needs one or more drafted tokens, each with its confidence")
        sure = [ok for conf, ok in zip(confidences, accepted, strict=True) if conf >= stop]
        unsure = [ok for conf, ok in zip(confidences, accepted, strict=True) if conf < stop]
        return cls(stop, len(sure) / len(confidences), _rate(sure), _rate(unsure))


def _rate(outcomes: Sequence[bool]) -> float:
    return sum(outcomes) / len(outcomes) if outcomes else 0.0  # an empty kind has weight 0 anyway


@dataclass(frozen=True)
class Costs:
    """Seconds of one target forward by the number of rows it scores (1 .. the most measured), and of
    one draft forward over one token."""

    target: Mapping[int, float]
    draft: float

    def __post_init__(self) -> None:
        if 1 not in self.target or any(s <= 0 for s in self.target.values()) or self.draft < 0:
            raise MarspecError("costs need the target's one-row forward and positive times")

    @property
    def max_k(self) -> int:
        """The longest draft whose verification was measured (its k + 1 rows)."""
        return max(self.target) - 1

    def verify(self, rows: int) -> float:
        """A target forward over ``rows`` rows: measured, else linear between the nearest measured."""
        if rows in self.target:
            return self.target[rows]
        below = max(n for n in self.target if n < rows)
        above = min((n for n in self.target if n > rows), default=None)
        if above is None:
            raise MarspecError(f"no target cost measured at or above {rows} rows")
        share = (rows - below) / (above - below)
        return self.target[below] + share * (self.target[above] - self.target[below])


def rising(measured: Mapping[int, float]) -> dict[int, float]:
    """Forward costs by rows with each one lowered to the cheapest at as many rows or more: a forward
    over more rows does at least the work of one over fewer, and other work on the machine only ever
    adds time, so a cost above a larger forward's is that noise (a slow stretch that would otherwise
    bend the choice toward or away from one draft length)."""
    out: dict[int, float] = {}
    cheapest = float("inf")
    for rows in sorted(measured, reverse=True):
        cheapest = min(cheapest, measured[rows])
        out[rows] = cheapest
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Prediction:
    """What the model expects of one setting: per step, the tokens emitted, the draft forwards spent and
    the seconds taken."""

    k: int
    stop: float
    tokens_per_step: float
    drafted_per_step: float
    seconds_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds_per_step


def predict(k: int, acceptance: Acceptance, costs: Costs) -> Prediction:
    """The expected step of drafts up to ``k`` tokens with ``acceptance``'s stop, at ``costs``."""
    if not 1 <= k <= costs.max_k:
        raise MarspecError(f"k must be in [1, {costs.max_k}] (the verifications measured), got {k}")
    sure, alpha = acceptance.sure, acceptance.alpha
    kept = sure * acceptance.accept_sure  # a token that was accepted and lets the draft go on
    tokens = 1 + sum(kept ** (j - 1) * alpha for j in range(1, k + 1))
    # A draft of n tokens: the first n - 1 sure, the n-th unsure (or n = k).
    lengths = {n: sure ** (n - 1) * (1 - sure) for n in range(1, k)}
    lengths[k] = sure ** (k - 1)
    drafted = sum(n * p for n, p in lengths.items())
    seconds = drafted * costs.draft + sum(p * costs.verify(n + 1) for n, p in lengths.items())
    return Prediction(k, acceptance.stop, tokens, drafted, seconds)


def choose(costs: Costs, acceptances: Iterable[Acceptance], max_k: int | None = None) -> Prediction:
    """The setting (draft length 1 .. ``max_k``, or as long as verification was measured, and one of the
    stops ``acceptances`` describe) with the most expected tokens per second; on a tie the shorter
    draft, then the lower stop."""
    top = costs.max_k if max_k is None else min(max_k, costs.max_k)
    candidates = [predict(k, a, costs) for a in acceptances for k in range(1, top + 1)]
    if not candidates:
        raise MarspecError("no setting to choose from: give at least one acceptance and a 2-row cost")
    return max(candidates, key=lambda p: (round(p.tokens_per_s, 9), -p.k, -p.stop))


def batched(sequences: int, costs: Costs) -> Costs:
    """The costs ``sequences`` decoded together meet, counted per sequence: a target forward over ``n``
    rows of each costs what one over ``sequences * n`` rows does (as measured, up to the most rows
    measured), and a draft forward over a token of each what the draft's one-token forward does, grown
    as the target's grows from one row to ``sequences`` (the draft's is measured at one row only)."""
    rows = {n: costs.target[sequences * n] for n in range(1, max(costs.target) // sequences + 1)}
    if not rows:
        raise MarspecError(f"no target cost measured at {sequences} rows")
    return Costs(rows, costs.draft * costs.target[sequences] / costs.target[1])


def drafting_pays(sequences: int, k: int, acceptance: Acceptance, costs: Costs) -> bool:
    """Whether ``sequences`` decoded together, each drafting up to ``k`` tokens at ``acceptance``'s stop,
    are expected to decode more tokens a second than the same sequences without drafts (a row each a
    step). Where a step of those drafts is past what was measured, drafting is taken to pay."""
    if sequences not in costs.target or sequences * (k + 1) > max(costs.target):
        return True
    drafting = predict(k, acceptance, batched(sequences, costs))
    return drafting.tokens_per_s > 1 / costs.target[sequences]
