"""Where a rule accepts a draft token the lossless test would not: the one door to each family's test.

Every verifier (greedy chain, token tree, sampling) and the vLLM plugin's batch rule ask
:func:`rule_relaxes` (or, row-wise only, :func:`relaxed_accepts`) which draft tokens a rule relaxes, and
narrow them by :func:`guarded`. Neither decides anything by a rule's name: they hand the scores to the
rule's family (:mod:`marspec.families`), whose file holds its test (MARS's close call, a rival's test on
the target's distribution, FLy's deferral over a block; the ensemble's tests read the draft's
distribution, which only the verifiers have, so they call them themselves).
"""

from __future__ import annotations

import torch

from marspec.errors import MarspecError
from marspec.families.base import Scores
from marspec.families.fly import fly_defers as fly_defers  # FLy's test, at the verifiers' path
from marspec.families.guards import guarded as guarded  # every verifier's, defined with the guards
from marspec.rules import Rule


def relaxed_accepts(
    rows: torch.Tensor,
    top_values: torch.Tensor,
    top_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    rule: Rule,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Bool ``[N]``: where ``rule`` accepts a draft token whatever the target ranks first (callers mask
    out exact matches), judging each row alone. ``rows`` (``[N, V]``) are the target's logits at the
    ``N`` positions, which a family that ``needs_rows`` reads; ``top_values``/``top_tokens`` are their
    :func:`top2` (values already divided by the temperature when sampling), which MARS's test reads. A
    family whose test needs the block (FLy) is refused: use :func:`rule_relaxes`."""
    if rule.family.row_refusal:
        raise MarspecError(rule.family.row_refusal)
    return rule.family.relaxed(Scores(rows, top_values, top_tokens, draft_tokens, None, temperature), rule)


def rule_relaxes(
    rows: torch.Tensor,
    top_values: torch.Tensor,
    top_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    native: torch.Tensor,
    rule: Rule,
    temperature: float = 1.0,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[N]``: where ``rule`` relaxes, whichever shape its family's decision has: over blocks
    (FLy's deferral, reading ``native``, where the lossless test passes, and ``lengths``, the blocks of a
    flattened batch) or row by row (reading ``top_values``/``top_tokens`` or ``rows``). The verifiers and
    the vLLM plugin's batch rule all decide here; callers mask out what the lossless test accepts."""
    scores = Scores(rows, top_values, top_tokens, draft_tokens, native, temperature, lengths)
    return rule.family.relaxed(scores, rule)
