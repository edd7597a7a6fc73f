"""The benchmark's records: one line of ``records.jsonl`` per (question, method, sample), typed and versioned.

A record holds every measurement a summary, a comparison or an audit needs, so nothing is decoded again
to summarize a run. Records carry their schema version; :func:`parse_record` is the one place that
reads older formats, filling the fields they did not keep with None, so the code after it sees one
shape.

Versions: 1 had no ``schema`` field and grew fields over time (the ones in ``_ADDED_TO_V1`` below may
be missing); 2 writes every field and ``schema``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from marspec.errors import MarspecError

if TYPE_CHECKING:  # the methods module imports torch: reading records needs neither
    from marspec.eval.methods import TurnOutput

RECORD_SCHEMA = 2

RecordKey = tuple[str, str, int]  # (question id, method, sample index)
CpuKey = tuple[str, str, int, str | None]  # RecordKey and the processor model the decode ran on


class TurnRecord(TypedDict):
    """One turn of a decode: its text and tokens, counters and timings (see GenerationStats)."""

    text: str
    new_tokens: int
    stopped_at_eos: bool
    wall_s: float
    target_forwards: int
    drafted: int
    accepted_exact: int
    accepted_relaxed: int
    rejected: int
    overhead_s: float | None  # None for a peer's loop (hf-*), which records no steps
    # Measured inside the forwards (prefill included), for every method: where the wall time went.
    target_forward_s: float | None
    draft_forward_s: float | None
    prefill_s: float | None  # for the ideal time (marspec.profile); None for a peer's loop
    prompt_tokens: int | None
    reused_tokens: int | None  # prompt tokens kept cached from the conversation's last turn
    verify_sizes: dict[Any, int] | None  # forwards by scored tokens (int keys, str once read from JSON)
    draft_forwards: int | None
    hit_limit: bool
    position_reached: list[int]
    position_accepted: list[int]
    margins: dict[str, list[float]]  # by outcome: exact, relaxed, rejected
    # What an audit of the output needs (marspec report --html): the tokens, and each relaxed one.
    token_ids: list[int] | None
    relaxed: list[Any] | None


class Record(TypedDict):
    """One decode of one question by one method: its turns, where and when it ran, and its grade."""

    schema: int
    qid: str
    method: str
    sample: int
    theta: float | None
    margin: str | None
    turns: list[TurnRecord]
    seeds: list[int | None]
    # Runs resumed or extended on another machine mix CPUs (whose kernels round near-ties differently):
    # each record says where it ran.
    cpu: str | None
    started: str | None  # UTC, ISO 8601 to the second
    other_cores: float | None  # other processes' load while it ran (marspec.eval.contention)
    score: float | None  # the grader's; None for a task without one (MT-Bench)
    answer: NotRequired[str | None]  # GSM8K: the extracted answer
    status: NotRequired[str]  # HumanEval: the sandbox's outcome


# Fields that version-1 records written before they existed lack (read as None).
_ADDED_TO_V1 = ("cpu", "started", "other_cores")
_TURN_FIELDS_ADDED_TO_V1 = (
    "overhead_s", "target_forward_s", "draft_forward_s", "prefill_s", "prompt_tokens", "reused_tokens",
    "verify_sizes", "draft_forwards", "token_ids", "relaxed",
)  # fmt: skip


def turn_record(out: TurnOutput) -> TurnRecord:
    """What one turn of a decode records."""
    s = out.stats
    reached, accepted = s.position_counts()
    return {
        "text": out.text,
        "new_tokens": s.new_tokens,
        "stopped_at_eos": s.stopped_at_eos,
        "wall_s": s.wall_s,
        "target_forwards": s.target_forwards,
        "drafted": s.drafted,
        "accepted_exact": s.accepted_exact,
        "accepted_relaxed": s.accepted_relaxed,
        "rejected": s.rejected,
        "overhead_s": s.overhead_s if s.steps else None,
        "target_forward_s": s.target_forward_s,
        "draft_forward_s": s.draft_forward_s,
        "prefill_s": s.prefill_s if s.steps else None,
        "prompt_tokens": s.prompt_tokens,
        "reused_tokens": s.reused_tokens,
        "verify_sizes": s.verify_sizes() if s.steps else None,
        "draft_forwards": s.draft_forwards,
        "hit_limit": out.hit_limit,
        "position_reached": reached,
        "position_accepted": accepted,
        "margins": {k: [round(v, 4) for v in vs] for k, vs in s.margins_by_outcome().items()},
        "token_ids": out.token_ids,
        "relaxed": out.relaxed,
    }


def parse_record(raw: dict[str, Any]) -> Record:
    """A record as read from ``records.jsonl``, in the current schema whatever version wrote it."""
    version = raw.get("schema", 1)
    if not isinstance(version, int) or version > RECORD_SCHEMA:
        raise MarspecError(
            f"a benchmark record has schema {version!r}, newer than this marspec reads ({RECORD_SCHEMA}): "
            "upgrade marspec to read this run"
        )
    if version == RECORD_SCHEMA:
        return raw  # type: ignore[return-value]  # written by turn_record's caller with every field
    record = {"schema": RECORD_SCHEMA, "sample": 0, **dict.fromkeys(_ADDED_TO_V1), **raw}
    record["schema"] = RECORD_SCHEMA
    record["turns"] = [{**dict.fromkeys(_TURN_FIELDS_ADDED_TO_V1), **turn} for turn in raw["turns"]]
    return record  # type: ignore[return-value]
