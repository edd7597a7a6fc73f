"""Task scoring for the benchmark: one grader per task, from :mod:`marspec.eval.graders`.

MT-Bench has no reachable judge, so its score is agreement with the baseline (plain decoding): chrF of
each turn against the baseline's turn, filled in when the summary is computed (``agreement``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from marspec.eval.datasets import Question
from marspec.eval.graders import chrf, extract_code, extract_gsm8k_answer, grade_gsm8k, run_humaneval

Grader = Callable[[Question, list[str]], dict[str, Any]]


def _gsm8k(question: Question, texts: list[str]) -> dict[str, Any]:
    assert question.reference is not None
    return {
        "score": float(grade_gsm8k(texts[0], question.reference)),
        "answer": extract_gsm8k_answer(texts[0]),
    }


def _humaneval(question: Question, texts: list[str]) -> dict[str, Any]:
    meta = question.meta
    program = extract_code(texts[0], meta["prompt"], meta["entry_point"])
    outcome = run_humaneval(program, meta["test"], meta["entry_point"])
    return {"score": float(outcome.passed), "status": outcome.status}


def _mtbench(question: Question, texts: list[str]) -> dict[str, Any]:
    return {"score": None}  # agreement with the baseline, computed in the summary


def grader_for(task: str) -> Grader:
    return {"gsm8k": _gsm8k, "humaneval": _humaneval, "mtbench": _mtbench}[task]


def agreement(texts: list[str], baseline: list[str]) -> dict[str, Any]:
    """Per-turn chrF (0..100) and exact match of a method's turns against the baseline's."""
    return {
        "chrf": [chrf(t, b) for t, b in zip(texts, baseline, strict=True)],
        "exact": [t == b for t, b in zip(texts, baseline, strict=True)],
    }
