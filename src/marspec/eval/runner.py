"""Running a benchmark task: every method on the same questions, interleaved, each decode appended to the
run's records as it finishes (so an interrupted run resumes where it stopped), then the summary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marspec.api import Decoder
from marspec.eval.bench import BenchConfig, runs_on
from marspec.eval.contention import LoadWatch, contended
from marspec.eval.cpu import cpu_name
from marspec.eval.datasets import Question
from marspec.eval.grading import Grader
from marspec.eval.methods import Method, TurnOutput, run_method
from marspec.eval.records import RECORD_SCHEMA, Record, parse_record, turn_record
from marspec.eval.rundir import RECORDS_FILE, load_costs, prepare_out_dir, save_costs
from marspec.eval.summary import timed_apart, write_summary
from marspec.profile import ForwardCosts, profile_pair


def sample_seed(qid: str, sample: int, turn: int) -> int:
    """The seed of one sampled turn: the same for every method, different across questions, samples
    and turns, and stable across runs and machines."""
    digest = hashlib.sha256(f"{qid}|{sample}|{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits


def run_bench(
    decoder: Decoder,
    questions: Sequence[Question],
    methods: Sequence[Method],
    config: BenchConfig,
    out_dir: Path,
    grade: Grader,
    on_done: Callable[[Question, Method, int, bool], None] | None = None,
    redo_contended: bool = False,
    redo_other_cpu: bool = False,
    redo_apart: bool = False,
) -> dict[str, Any]:
    """Run (or resume) the benchmark and write its summary. ``grade(question, turn_texts)`` returns at
    least ``{"score": float | None}``; ``on_done(question, method, sample, skipped)`` reports progress.
    With ``redo_contended``, records decoded while other processes loaded the machine are decoded again,
    and with ``redo_other_cpu`` those decoded on another processor model than this machine's (a run
    resumed elsewhere) wherever their question's sample is decoded here too (a method still to decode, a
    record to redo, or one already made here), so every question's speed ratios come from one CPU; a
    sample whole on another CPU keeps its records, whose ratios pair decodes of that CPU. With
    ``redo_apart``, a question whose methods' records were not timed back to back
    (:func:`~marspec.eval.summary.timed_apart`: a baseline decoded again in a later sitting, or a method
    added then) has all of them decoded again, one after another. A new record is appended and
    supersedes the old one (the summary keeps an old one as the baseline of the decodes made on its CPU)."""

    here = cpu_name()

    def elsewhere(record: Record) -> bool:
        return record["cpu"] is not None and record["cpu"] != here

    records = prepare_out_dir(out_dir, config)
    with (out_dir / RECORDS_FILE).open("a") as sink:
        for index, question in enumerate(questions):
            for sample in range(config.samples):
                # Decided before any of the question's decodes: a redo makes its records back to back.
                keys = [(question.qid, m.name, sample) for m in methods if runs_on(m.name, index, config)]
                have = [records[k] for m in methods if (k := (question.qid, m.name, sample)) in records]
                apart = redo_apart and timed_apart(have)
                busy = {k for k in keys if redo_contended and k in records and contended(records[k])}
                # Every method's records of this sample, listed or not: a baseline decoded again alone
                # (--methods strict) joins the methods already decoded on this CPU.
                sample_records = [r for (q, _, s), r in records.items() if (q, s) == (question.qid, sample)]
                gather = redo_other_cpu and (
                    bool(busy)
                    or any(k not in records for k in keys)
                    or any(r["cpu"] == here for r in sample_records)
                )
                for method in methods:
                    if not runs_on(method.name, index, config):
                        continue
                    key = (question.qid, method.name, sample)
                    moved = gather and key in records and elsewhere(records[key])
                    if key in records and not (apart or key in busy or moved):
                        if on_done:
                            on_done(question, method, sample, True)
                        continue
                    started = datetime.now(UTC).isoformat(timespec="seconds")
                    with LoadWatch() as load:
                        turns = _run_turns(decoder, method, question, sample, config)
                    rec: dict[str, Any] = {
                        "schema": RECORD_SCHEMA,
                        "qid": question.qid,
                        "method": method.name,
                        "sample": sample,
                        "theta": method.theta,
                        "margin": method.margin or config.margin,
                        "turns": [turn_record(t) for t in turns],
                        "seeds": [t.seed for t in turns],
                        "cpu": cpu_name(),
                        "started": started,
                        "other_cores": load.other_cores,  # see marspec.eval.contention
                        **grade(question, [t.text for t in turns]),
                    }
                    line = json.dumps(rec)
                    sink.write(line + "\n")
                    sink.flush()
                    records[key] = parse_record(json.loads(line))  # as a resumed run will read it
                    if on_done:
                        on_done(question, method, sample, False)
    return write_summary(out_dir, config, [m.name for m in methods], [q.qid for q in questions], records)


def profile_once(decoder: Decoder, config: BenchConfig, out_dir: Path) -> ForwardCosts:
    """The forward-cost profile of this run's models (measured once; a resumed run keeps the first)."""
    costs = load_costs(out_dir)
    if costs is None:
        draft_lm = decoder.drafter.draft_model if decoder.drafter else None
        shape = config.tree_shape
        siblings = sum(width - 1 for width in shape) if shape else 0
        costs = profile_pair(decoder.target, draft_lm, max_tokens=config.k + 1 + siblings)
        save_costs(out_dir, costs)
    return costs


def _run_turns(
    decoder: Decoder, method: Method, question: Question, sample: int, config: BenchConfig
) -> list[TurnOutput]:
    """Multi-turn questions continue the method's own conversation, as a user of that method would."""
    messages: list[dict[str, str]] = []
    outputs = []
    for turn, user_turn in enumerate(question.turns):
        messages.append({"role": "user", "content": user_turn})
        out = run_method(
            decoder,
            method,
            messages,
            k=config.k,
            max_new_tokens=config.max_new_tokens,
            margin=config.margin,
            tree=config.tree_shape,
            temperature=config.temperature,
            seed=sample_seed(question.qid, sample, turn) if config.temperature > 0 else None,
            reuse_prefix=config.prefix_reuse and turn > 0,
        )
        messages.append({"role": "assistant", "content": out.text})
        outputs.append(out)
    return outputs
