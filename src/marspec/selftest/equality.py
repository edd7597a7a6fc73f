"""Token-for-token checks: strict equals plain, and each relaxing rule at a setting that cannot relax
equals strict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marspec.api import Decoder

from marspec.selftest.report import Check

PROMPTS = ("def add(a, b): return a + b", "The cache holds every token.", "1 + 1 = 2, 2 + 2 =")
NEW_TOKENS = 40
K = 4
TREE = "3,2"


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first index where two token sequences differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_runs(name: str, runs: list[tuple[str, list[int], list[int]]]) -> Check:
    """A check that every run's tokens equal its reference: ``runs`` holds ``(label, expected, got)``.
    The detail names the first difference found."""
    for label, expected, got in runs:
        at = first_difference(expected, got)
        if at is not None:
            want = expected[at] if at < len(expected) else "end"
            have = got[at] if at < len(got) else "end"
            return Check(name, False, f"{label}: token {at} is {have}, expected {want}")
    tokens = sum(len(expected) for _, expected, _ in runs)
    return Check(name, True, f"{len(runs)} runs, {tokens} tokens, all identical")


def strict_equals_plain(decoder: Decoder) -> Check:
    """Strict verification (chain and tree) emits plain greedy decoding's tokens, and really drafted."""
    name = "strict == plain (greedy, chain and tree)"
    runs = []
    drafted = accepted = rejected = 0
    for i, prompt in enumerate(PROMPTS):
        plain = generate_greedy(decoder, prompt, rule="plain")
        for tree in (None, TREE):
            out = decoder.generate(prompt, rule="strict", tree=tree, **_greedy())
            label = f"prompt {i + 1}, strict {'tree ' + tree if tree else 'chain'}"
            runs.append((label, plain, out.token_ids))
            drafted += out.stats.drafted
            accepted += out.stats.accepted_exact
            rejected += out.stats.rejected
    check = compare_runs(name, runs)
    if check.passed and not (accepted and rejected):
        # Without both, the comparison proves nothing about verification.
        return Check(name, False, f"vacuous: {accepted} drafts accepted, {rejected} steps with a rejection")
    share = f"{accepted} of {drafted} drafts accepted, {rejected} rejections"
    return Check(name, check.passed, f"{check.detail}; {share}" if check.passed else check.detail)


# Each lossy rule's family at a setting that can never relax: MARS at theta 1 (both ratio margins), FLy
# above its largest possible entropy (ln 3; a 1-token window, which fits in K, so only the threshold holds
# it back), and MARS at theta 1 under the class guard (the guard's table lookup on the device runs, and
# must change nothing).
NO_RELAX = (
    ("mars prob_ratio 1", {"rule": "mars", "theta": 1.0, "margin": "prob_ratio"}),
    ("mars logit_ratio 1", {"rule": "mars", "theta": 1.0, "margin": "logit_ratio"}),
    ("fly 1.1 window 1", {"rule": "fly", "theta": 1.1, "window": 1}),
    ("mars+class 1", {"rule": "mars", "theta": 1.0, "margin": "prob_ratio", "guard": "class"}),
)
NO_RELAX_CHECK = "rules that cannot relax == strict"


def no_relax_equals_strict(decoder: Decoder) -> Check:
    """MARS at theta = 1, FLy above ln 3 and guarded MARS at theta 1, none of which can relax, emit
    strict's tokens."""
    runs = []
    for i, prompt in enumerate(PROMPTS):
        strict = generate_greedy(decoder, prompt, rule="strict")
        for label, options in NO_RELAX:
            runs.append((f"prompt {i + 1}, {label}", strict, generate_greedy(decoder, prompt, **options)))
    return compare_runs(NO_RELAX_CHECK, runs)


def _greedy() -> dict[str, Any]:
    return {"k": K, "max_new_tokens": NEW_TOKENS, "chat": False, "temperature": 0.0}


def generate_greedy(decoder: Decoder, prompt: str, **options: Any) -> list[int]:
    """The token ids of a greedy decode of ``prompt`` at the self-test's length and draft length."""
    return decoder.generate(prompt, **_greedy(), **options).token_ids
