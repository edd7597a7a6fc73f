"""Per-step records of a generation and the metrics derived from them (docs/method.md, "What is measured")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def mean_accepted_length(new_tokens: int, eos_stops: int, target_forwards: int) -> float | None:
    """tau: tokens generated per target verification forward (plain decoding: 1.0). ``eos_stops`` counts
    the generations that ended at an end-of-sequence token, which was generated too although it is not
    among the ``new_tokens`` returned; None when nothing was verified. :attr:`GenerationStats.tau` and
    the benchmark's summaries (over many generations) both count it this way."""
    return (new_tokens + eos_stops) / target_forwards if target_forwards else None


@dataclass(frozen=True)
class StepRecord:
    """One target verification forward and what it yielded."""

    drafted: int  # draft tokens proposed (0 for plain decoding)
    accepted_exact: int
    accepted_relaxed: int
    rejected: bool  # a draft token was rejected (False when all were accepted, or none drafted)
    emitted: int  # tokens kept from this step (accepted + correction/bonus, cut at EOS/limits)
    margins: tuple[float, ...] = ()  # the rule's margin measure at each drafted position
    siblings: int = 0  # extra tree nodes scored beside the drafted chain (token-tree drafting)
    relaxed_at: tuple[int, ...] = ()  # draft positions accepted by relaxation
    # Drafts after an accepted EOS: scored by the verification (their cost is in ``drafted``) but never
    # judged, because the text ended before them; acceptance counts leave them out.
    unjudged: int = 0


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    ``tau`` is generated tokens (a final EOS included) per target verification forward (plain: 1.0).
    ``overhead_s`` is the engine's own time: wall time minus the time inside model forwards (prefill
    included).
    """

    new_tokens: int = 0  # tokens returned to the caller (an EOS that ended generation is not among them)
    stopped_at_eos: bool = False
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose cache was kept from the previous sequence (not scored)
    target_forwards: int = 0
    draft_forwards: int = 0  # forwards of a draft model (lookup drafts cost none)
    drafted: int = 0
    unjudged: int = 0  # drafts after an accepted EOS (see StepRecord.unjudged)
    accepted_exact: int = 0
    accepted_relaxed: int = 0
    rejected: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    target_forward_s: float = 0.0
    draft_forward_s: float = 0.0
    steps: list[StepRecord] = field(default_factory=list, repr=False)

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        self.target_forwards += 1
        self.drafted += step.drafted
        self.unjudged += step.unjudged
        self.accepted_exact += step.accepted_exact
        self.accepted_relaxed += step.accepted_relaxed
        self.rejected += int(step.rejected)

    @property
    def tau(self) -> float:
        """Mean accepted length: new tokens per target verification forward (0.0 before any)."""
        return mean_accepted_length(self.new_tokens, int(self.stopped_at_eos), self.target_forwards) or 0.0

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.wall_s - self.target_forward_s - self.draft_forward_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def relaxed_share(self) -> float:
        """Share of accepted draft tokens that were accepted by relaxation."""
        accepted = self.accepted_exact + self.accepted_relaxed
        return self.accepted_relaxed / accepted if accepted else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / judged draft tokens (drafts after an accepted EOS are not judged)."""
        judged = self.drafted - self.unjudged
        return (self.accepted_exact + self.accepted_relaxed) / judged if judged else 0.0

    def position_counts(self) -> tuple[list[int], list[int]]:
        """Per draft position (index 0 = first drafted token): how many steps drafted that far, and how
        many of those accepted the token there."""
        reached: list[int] = []
        accepted: list[int] = []
        for step in self.steps:
            n_accepted = step.accepted_exact + step.accepted_relaxed
            for pos in range(step.drafted - step.unjudged):
                if pos == len(reached):
                    reached.append(0)
                    accepted.append(0)
                reached[pos] += 1
                accepted[pos] += int(pos < n_accepted)
        return reached, accepted

    def accepted_by_position(self) -> list[float]:
        """Acceptance rate at each draft position, over the steps that drafted that far."""
        reached, accepted = self.position_counts()
        return [a / r for a, r in zip(accepted, reached, strict=True)]

    def verify_sizes(self) -> dict[int, int]:
        """How many verification forwards scored each number of tokens (1 + drafted + siblings): with a
        forward-cost profile this gives the ideal time of the run (see :mod:`marspec.profile`)."""
        sizes: dict[int, int] = {}
        for step in self.steps:
            scored = 1 + step.drafted + step.siblings
            sizes[scored] = sizes.get(scored, 0) + 1
        return sizes

    def margins_by_outcome(self) -> dict[str, list[float]]:
        """The margin measure at every verified draft position, grouped by what the rule decided there
        (positions after the first rejection were never judged and are left out)."""
        out: dict[str, list[float]] = {"exact": [], "relaxed": [], "rejected": []}
        for step in self.steps:
            n_accepted = step.accepted_exact + step.accepted_relaxed
            for pos, margin in enumerate(step.margins[: n_accepted + 1]):
                if pos == n_accepted:
                    out["rejected"].append(margin)
                else:
                    out["relaxed" if pos in step.relaxed_at else "exact"].append(margin)
        return out

    def to_dict(self, with_steps: bool = False) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "steps"}
        out.update(
            tau=self.tau,
            overhead_s=self.overhead_s,
            tokens_per_s=self.tokens_per_s,
            relaxed_share=self.relaxed_share,
            acceptance_rate=self.acceptance_rate,
            verify_sizes=self.verify_sizes(),
        )
        if with_steps:
            out["steps"] = [asdict(s) for s in self.steps]
        return out
