"""A benchmark run's folder: what is in it and how it is read and written.

``DIR/config.json`` guards against mixing configurations; results stream to ``DIR/records.jsonl`` (one
line per question, sample and method), so an interrupted run resumes where it stopped; ``profile.json``
holds the models' forward costs, measured once; ``summary.json`` and ``summary.md`` hold the metrics of
docs/method.md ("What is measured").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from marspec.errors import MarspecError
from marspec.eval.bench import ADDABLE_FIELDS, BenchConfig, runs_on
from marspec.eval.records import CpuKey, Record, RecordKey, parse_record
from marspec.eval.render import summary_markdown
from marspec.profile import ForwardCosts

CONFIG_FILE, RECORDS_FILE, PROFILE_FILE = "config.json", "records.jsonl", "profile.json"
SUMMARY_JSON, SUMMARY_MD = "summary.json", "summary.md"


def prepare_out_dir(out_dir: Path, config: BenchConfig) -> dict[RecordKey, Record]:
    """Create ``out_dir`` or check it holds a comparable configuration; return the records already there.

    The stored config lists every method ever run in the directory, in first-run order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / CONFIG_FILE
    wanted = asdict(config)
    wanted["methods"] = list(config.methods)
    if config_path.exists():
        # A field missing from an older run's config had its default value then.
        have = {**{f.name: f.default for f in fields(BenchConfig)}, **json.loads(config_path.read_text())}
        keys = (set(have) | set(wanted)) - set(ADDABLE_FIELDS)
        diff = sorted(k for k in keys if have.get(k) != wanted.get(k))
        if diff:
            detail = "; ".join(f"{k}: {have.get(k)!r} there, {wanted.get(k)!r} now" for k in diff)
            raise MarspecError(
                f"{out_dir} holds results of a different configuration ({detail}); refusing to mix them: "
                "use another --out directory or delete this one"
            )
        wanted["methods"] = list(dict.fromkeys([*have["methods"], *config.methods]))
    config_path.write_text(json.dumps(wanted, indent=2) + "\n")
    return load_records(out_dir)


def load_records(out_dir: Path) -> dict[RecordKey, Record]:
    """Records by (question id, method, sample), in the current schema. A torn last line left by an
    interrupted run is cut off, so the next record starts on a line of its own; where a key appears
    twice (a record decoded again), the later line wins."""
    return {(rec["qid"], rec["method"], rec["sample"]): rec for rec in _read_records(out_dir)}


def load_records_by_cpu(out_dir: Path) -> dict[CpuKey, Record]:
    """The newest record of each (question id, method, sample) on each processor model it was decoded
    on. A decode done again on another CPU supersedes the old one in :func:`load_records`; the old one
    stays the baseline for the other methods decoded on its CPU, so a speed ratio never pairs two
    machines."""
    return {(rec["qid"], rec["method"], rec["sample"], rec["cpu"]): rec for rec in _read_records(out_dir)}


def _read_records(out_dir: Path) -> list[Record]:
    """Every record of ``records.jsonl`` in file order (oldest first), a torn last line cut off."""
    path = out_dir / RECORDS_FILE
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    records = []
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        records.append(parse_record(raw))
    return records


def read_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A benchmark run's ``(config, summary)`` as written, or a MarspecError naming what is missing."""
    paths = run_dir / CONFIG_FILE, run_dir / SUMMARY_JSON
    if not all(p.is_file() for p in paths):
        raise MarspecError(
            f"{run_dir} is not a finished benchmark run (no config.json and summary.json): "
            "run marspec bench first"
        )
    try:
        return json.loads(paths[0].read_text()), json.loads(paths[1].read_text())
    except json.JSONDecodeError as exc:
        raise MarspecError(f"{run_dir} holds a corrupt config.json or summary.json: {exc}") from None


def whole_run(run_dir: Path) -> tuple[BenchConfig, dict[str, Any]]:
    """A finished run's ``(config, summary)``; a MarspecError if any planned decode of its methods on its
    questions is missing, so a partial run is never read as a whole one."""
    config, summary, _ = read_whole_run(run_dir)
    return config, summary


def read_whole_run(run_dir: Path) -> tuple[BenchConfig, dict[str, Any], dict[RecordKey, Record]]:
    """:func:`whole_run` with the run's records."""
    raw, summary = read_run(run_dir)
    try:
        config = BenchConfig(**{**raw, "methods": tuple(raw["methods"])})
    except TypeError as exc:  # a field added since has no default, or one was removed
        raise MarspecError(f"{run_dir} was written by an older marspec ({exc}): it cannot be read") from None
    if not (run_dir / RECORDS_FILE).is_file():
        raise MarspecError(
            f"{run_dir} holds a summary but no {RECORDS_FILE}: without its records it cannot be checked "
            "whole or summarized again"
        )
    records = load_records(run_dir)
    qids = summarized_qids(summary, records)
    missing = len(qids) != summary["questions"] or not all(
        (qid, method, sample) in records
        for index, qid in enumerate(qids)
        for method in summary["methods"]
        if runs_on(method, index, config)
        for sample in range(config.samples)
    )
    if missing:
        raise MarspecError(f"{run_dir} is not a whole run: finish it (rerun its marspec bench) first")
    return config, summary, records


def summarized_qids(summary: dict[str, Any], records: Mapping[RecordKey, Record]) -> list[str]:
    """The questions a summary covers (for summaries written before they listed them: the questions the
    records hold)."""
    return summary.get("qids") or list(dict.fromkeys(q for q, _, _ in records))


def load_costs(out_dir: Path) -> ForwardCosts | None:
    """The run's forward-cost profile, or None before one was measured."""
    path = out_dir / PROFILE_FILE
    return ForwardCosts.from_dict(json.loads(path.read_text())) if path.exists() else None


def save_costs(out_dir: Path, costs: ForwardCosts) -> None:
    (out_dir / PROFILE_FILE).write_text(json.dumps(costs.to_dict(), indent=2) + "\n")


def save_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json`` and its markdown, ``summary.md``."""
    (out_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / SUMMARY_MD).write_text(summary_markdown(summary))
