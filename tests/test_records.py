"""The benchmark records' schema: one reader for every version, and tau counted one way everywhere."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import bench_config

from marspec import MarspecError
from marspec.eval.records import RECORD_SCHEMA, parse_record
from marspec.eval.render import summary_markdown
from marspec.eval.rundir import RECORDS_FILE, load_records, load_records_by_cpu
from marspec.eval.summary import summarize
from marspec.stats import GenerationStats, StepRecord, mean_accepted_length

TURN_V1 = {
    "text": "4",
    "new_tokens": 3,
    "stopped_at_eos": True,
    "wall_s": 0.5,
    "target_forwards": 2,
    "drafted": 3,
    "accepted_exact": 2,
    "accepted_relaxed": 0,
    "rejected": 1,
    "hit_limit": False,
    "position_reached": [2, 1],
    "position_accepted": [2, 0],
    "margins": {"exact": [0.9, 0.8], "relaxed": [], "rejected": [0.1]},
}
RECORD_V1 = {
    "qid": "gsm8k/0",
    "method": "strict",
    "theta": 1.0,
    "margin": "logit_ratio",
    "turns": [TURN_V1],
    "seeds": [None],
    "score": 1.0,
    "answer": "4",
}


def test_a_version_1_record_is_read_in_the_current_shape() -> None:
    rec = parse_record(json.loads(json.dumps(RECORD_V1)))
    assert rec["schema"] == RECORD_SCHEMA
    assert rec["sample"] == 0  # records from before sampling: one decode per question
    assert (rec["cpu"], rec["started"], rec["other_cores"]) == (None, None, None)
    (turn,) = rec["turns"]
    for field in ("target_forward_s", "draft_forward_s", "prefill_s", "verify_sizes", "token_ids", "relaxed"):
        assert turn[field] is None, field
    assert turn["new_tokens"] == 3 and rec["answer"] == "4"  # what it kept is kept
    # A field a version-1 record did keep is not overwritten by the filling.
    kept = parse_record({**RECORD_V1, "cpu": "Some CPU", "sample": 2})
    assert (kept["cpu"], kept["sample"]) == ("Some CPU", 2)


def test_a_record_from_a_newer_marspec_is_refused() -> None:
    with pytest.raises(MarspecError, match="newer than this marspec"):
        parse_record({**RECORD_V1, "schema": RECORD_SCHEMA + 1})


def test_the_folder_reader_upgrades_old_lines_and_lets_the_last_line_win(tmp_path: Path) -> None:
    newer = {**parse_record(RECORD_V1), "score": 0.0}
    lines = [json.dumps(RECORD_V1), "not json", json.dumps(newer)]
    (tmp_path / RECORDS_FILE).write_text("\n".join(lines) + "\n" + '{"qid": "torn')
    records = load_records(tmp_path)
    assert list(records) == [("gsm8k/0", "strict", 0)]
    assert records["gsm8k/0", "strict", 0]["score"] == 0.0
    assert (tmp_path / RECORDS_FILE).read_text().endswith("\n")  # the torn line is cut off


def test_tau_is_one_function() -> None:
    stats = GenerationStats(new_tokens=5, stopped_at_eos=True)
    for _ in range(3):
        stats.record(StepRecord(drafted=2, accepted_exact=1, accepted_relaxed=0, rejected=True, emitted=2))
    assert stats.tau == mean_accepted_length(5, 1, 3) == 2.0  # the final EOS counts as generated
    assert GenerationStats().tau == 0.0 and mean_accepted_length(0, 0, 0) is None


def _timed(qid: str, method: str, cpu: str, tokens_per_s: float, started: str = "10:00") -> dict:
    """A version-1-shaped record of ``method`` on ``qid`` decoded on ``cpu`` at ``tokens_per_s``, started
    at ``started`` (UTC) on one day."""
    turn = {**TURN_V1, "new_tokens": 12, "wall_s": 12 / tokens_per_s}
    when = f"2026-11-26T{started}:00+00:00"
    return {**RECORD_V1, "qid": qid, "method": method, "cpu": cpu, "turns": [turn], "started": when}


def test_a_speed_ratio_pairs_decodes_made_on_the_same_cpu(tmp_path: Path) -> None:
    # Strict ran on an old machine, then again on a new one (a resumed run's --redo-other-cpu); the rule
    # ran on the old one for q0, the new one for q1, and a third for q2, where strict never ran.
    lines = [
        _timed("gsm8k/0", "strict", "old", 10.0),
        _timed("gsm8k/0", "mars@0.5", "old", 12.0),
        _timed("gsm8k/0", "strict", "new", 20.0),
        _timed("gsm8k/1", "strict", "new", 20.0, started="12:30"),  # decoded again in a later sitting
        _timed("gsm8k/1", "mars@0.5", "new", 30.0),
        _timed("gsm8k/2", "strict", "new", 20.0),
        _timed("gsm8k/2", "mars@0.5", "third", 50.0),
    ]
    (tmp_path / RECORDS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = bench_config("strict,mars@0.5")
    qids = ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    by_cpu = load_records_by_cpu(tmp_path)
    assert by_cpu["gsm8k/0", "strict", 0, "old"]["turns"][0]["wall_s"] == 12 / 10.0  # superseded, kept
    summary = summarize(config, config.methods, qids, load_records(tmp_path), by_cpu=by_cpu)
    rule = summary["methods"]["mars@0.5"]
    assert (rule["speed_questions"], rule["speed_unpaired"], rule["speed_apart"]) == (2, 1, 1)
    assert rule["speedup"] == pytest.approx((12 + 30) / (10 + 20))  # q0 against old strict, not new
    assert rule["speedup_median"] == pytest.approx(statistics.median([12 / 10, 30 / 20]))
    assert summary["methods"]["strict"]["speedup"] == pytest.approx(1.0)
    markdown = summary_markdown(summary)
    assert "Decoded on 3 processor models" in markdown and "their CPU (mars@0.5 1 questions)" in markdown
    assert "**Speed timed in different sittings** (mars@0.5 1 questions)" in markdown
    # Without the per-CPU records every newest decode is paired, machines and all: the old behaviour.
    blind = summarize(config, config.methods, qids, load_records(tmp_path))["methods"]["mars@0.5"]
    assert blind["speed_questions"] == 3 and blind["speedup"] == pytest.approx((12 + 30 + 50) / 60)
