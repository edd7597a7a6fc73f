"""MT-Bench agreement: no judge model is reachable, so a method's text is compared with plain decoding's."""

from __future__ import annotations

from functools import cache
from typing import Any

from marspec.errors import MarspecError


@cache
def _chrf_metric() -> Any:
    try:
        from sacrebleu.metrics import CHRF
    except ImportError as e:
        raise MarspecError("sacrebleu is not installed: run `pip install 'marspec[eval]'`") from e
    return CHRF()


def chrf(hypothesis: str, reference: str) -> float:
    """Sentence-level chrF (sacrebleu defaults: character 6-grams, beta 2), from 0 to 100.

    Identical strings score 100 (also when both are empty, where sacrebleu would say 0). Like sacrebleu,
    whitespace is ignored, so texts differing only in spacing also score 100: use :func:`exact_match`
    for byte-identity.
    """
    if not isinstance(hypothesis, str) or not isinstance(reference, str):
        raise MarspecError("chrf compares two strings: pass the decoded texts, not token ids")
    if hypothesis == reference:
        return 100.0
    return float(_chrf_metric().sentence_score(hypothesis, [reference]).score)


def exact_match(a: str, b: str) -> bool:
    """Whether two texts are identical, character for character (no stripping or normalising)."""
    if not isinstance(a, str) or not isinstance(b, str):
        raise MarspecError("exact_match compares two strings: pass the decoded texts, not token ids")
    return a == b
