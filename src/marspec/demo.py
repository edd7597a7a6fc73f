"""The main job: plain, strict speculative and MARS decoding side by side on built-in prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from marspec.api import Decoder, GenerationResult
from marspec.rules import LOSSLESS_RULES
from marspec.stats import mean_accepted_length

# A handful of prompts across the kinds of work the paper measures: code, math and chat.
DEMO_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function `is_prime(n)` that returns True if n is prime, with a docstring."),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    (
        "math",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? Think step by step.",
    ),
    ("chat", "Give three short tips for writing clear commit messages."),
)

METHODS: tuple[tuple[str, dict], ...] = (
    ("plain", {"rule": "plain"}),
    ("strict", {"rule": "strict"}),
    ("mars", {"rule": "mars"}),
)


@dataclass
class MethodSummary:
    """Aggregates over the prompts for one method."""

    name: str
    results: list[GenerationResult] = field(default_factory=list)
    same_as_plain: int = 0

    @property
    def lossless(self) -> bool:
        """Whether the method returns the target's own decoding (plain, strict) rather than relaxing."""
        return dict(METHODS)[self.name]["rule"] in LOSSLESS_RULES

    @property
    def tokens(self) -> int:
        return sum(r.stats.new_tokens for r in self.results)

    @property
    def wall_s(self) -> float:
        return sum(r.stats.wall_s for r in self.results)

    @property
    def mean_tokens_per_s(self) -> float:
        """Per-prompt mean of tokens/s (the Spec-Bench speedup numerator)."""
        return sum(r.stats.tokens_per_s for r in self.results) / len(self.results)

    @property
    def tau(self) -> float:
        eos_stops = sum(r.stats.stopped_at_eos for r in self.results)
        forwards = sum(r.stats.target_forwards for r in self.results)
        return mean_accepted_length(self.tokens, eos_stops, forwards) or 0.0

    @property
    def relaxed_share(self) -> float:
        relaxed = sum(r.stats.accepted_relaxed for r in self.results)
        accepted = relaxed + sum(r.stats.accepted_exact for r in self.results)
        return relaxed / accepted if accepted else 0.0

    @property
    def overhead_share(self) -> float:
        return sum(r.stats.overhead_s for r in self.results) / self.wall_s if self.wall_s else 0.0


def run_demo(
    decoder: Decoder,
    prompts: Sequence[tuple[str, str]] = DEMO_PROMPTS,
    *,
    k: int | None = None,
    theta: float | str | None = None,
    max_new_tokens: int = 128,
    on_result: Callable[[str, str, GenerationResult], None] | None = None,
) -> list[MethodSummary]:
    """Run every method on every prompt, interleaved prompt by prompt so machine drift hits all alike."""
    summaries = {name: MethodSummary(name) for name, _ in METHODS}
    for kind, prompt in prompts:
        plain_ids: list[int] | None = None
        for name, options in METHODS:
            # Every method scores the prompt itself: a kept prefix would make later methods look faster.
            result = decoder.generate(
                prompt, k=k, theta=theta, max_new_tokens=max_new_tokens, reuse_prefix=False, **options
            )
            if plain_ids is None:
                plain_ids = result.token_ids
            summary = summaries[name]
            summary.results.append(result)
            summary.same_as_plain += int(result.token_ids == plain_ids)
            if on_result is not None:
                on_result(kind, name, result)
    return list(summaries.values())
