"""Comparing one method of a benchmark run with a method of another run on the questions both ran.

The bench compares methods inside one run. Some controls need two: strict decoding in bf16 against
strict in fp32 (the noise floor of rounding alone) cannot share one process's loaded models. The
per-question scores (means over samples) of both sides are paired by question id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from marspec.errors import MarspecError
from marspec.eval.intervals import Estimate, difference_interval, ratio_interval
from marspec.eval.rundir import load_records


@dataclass(frozen=True)
class Comparison:
    questions: int
    reference_score: float
    score: float
    recovery: Estimate
    difference: Estimate
    changed: int  # questions whose text differs in some sample
    lost: int  # questions scored lower than the reference
    won: int  # questions scored higher
    # Per question whose tokens differ, the index of the first token that does (its samples' and turns'
    # tokens one after another), in question order: how far the other side follows the reference. Only
    # questions both runs recorded token ids for (records before those were kept have none).
    first_divergences: tuple[int, ...] = ()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (or where the shorter ends); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def parse_side(text: str) -> tuple[Path, str]:
    """``DIR:METHOD`` -> (run directory, method name)."""
    folder, sep, method = text.rpartition(":")
    if not sep or not folder or not method:
        raise MarspecError(f"{text!r} is not RUN_DIR:METHOD (e.g. runs/humaneval-bf16:strict)")
    return Path(folder), method


def _scores(folder: Path, method: str) -> tuple[dict[str, float], dict[str, list[str]], dict[str, list[int]]]:
    records = load_records(folder)
    if not records:
        raise MarspecError(f"{folder} holds no benchmark records: run `marspec bench --out {folder}` first")
    scores: dict[str, list[float]] = {}
    texts: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    for (qid, name, sample), rec in sorted(records.items()):
        if name != method:
            continue
        if rec.get("score") is None:
            raise MarspecError(f"{folder}: method {method!r} has no task score (only graded tasks compare)")
        scores.setdefault(qid, []).append(float(rec["score"]))
        texts.setdefault(qid, []).append(" ".join(t["text"] for t in rec["turns"]) + f"#{sample}")
        tokens.setdefault(qid, []).extend(i for t in rec["turns"] for i in t.get("token_ids") or ())
    if not scores:
        raise MarspecError(f"{folder} has no records of method {method!r}")
    return {q: sum(v) / len(v) for q, v in scores.items()}, texts, tokens


def compare_runs(reference: tuple[Path, str], other: tuple[Path, str]) -> Comparison:
    ref_scores, ref_texts, ref_tokens = _scores(*reference)
    scores, texts, tokens = _scores(*other)
    common = [q for q in ref_scores if q in scores]
    if not common:
        raise MarspecError("the two runs share no question: compare runs of the same task and questions")
    a, b = [scores[q] for q in common], [ref_scores[q] for q in common]
    return Comparison(
        questions=len(common),
        reference_score=sum(b) / len(b),
        score=sum(a) / len(a),
        recovery=ratio_interval(a, b),
        difference=difference_interval(a, b),
        changed=sum(texts[q] != ref_texts[q] for q in common),
        lost=sum(x < y for x, y in zip(a, b, strict=True)),
        won=sum(x > y for x, y in zip(a, b, strict=True)),
        first_divergences=tuple(
            d
            for q in common
            if tokens[q]
            and ref_tokens[q]  # older records kept no token ids
            and (d := first_difference(tokens[q], ref_tokens[q])) is not None
        ),
    )
