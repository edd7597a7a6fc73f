"""The side-by-side benchmark: every method on the same questions, in one process, interleaved.

Results stream to ``DIR/records.jsonl`` (one line per question, sample and method), so an interrupted
run resumes where it stopped; ``DIR/config.json`` guards against mixing configurations; ``summary.json``
and ``summary.md`` hold the metrics of docs/method.md ("What is measured") with 95% bootstrap intervals
over questions for scores and recovery.

Under sampling (``temperature > 0``) each question is decoded ``samples`` times per method, with seeds
derived from (question, sample, turn) and shared by all methods; a question's score is its mean over
samples. Plain decoding may run on the first ``plain_limit`` questions only: it is needed for the speed
baseline, while strict speculative decoding (plain's equal, token for token when greedy and in
distribution when sampling) is the quality reference.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from marspec.api import Decoder
from marspec.errors import MarspecError
from marspec.eval.contention import CONTENDED_CORES, LoadWatch, contended
from marspec.eval.datasets import Question
from marspec.eval.grading import Grader, agreement
from marspec.eval.intervals import Estimate, difference_interval, mean_interval, ratio_interval
from marspec.eval.methods import Method, TurnOutput, run_method
from marspec.profile import ForwardCosts, ideal_seconds, profile_pair
from marspec.stats import GenerationStats
from marspec.tree import parse_tree_shape

# Long enough for answers to finish: GSM8K chain-of-thought needs several hundred tokens.
DEFAULT_MAX_NEW_TOKENS = {"humaneval": 512, "gsm8k": 512, "mtbench": 512}
CONFIG_FILE, RECORDS_FILE, PROFILE_FILE = "config.json", "records.jsonl", "profile.json"
SUMMARY_JSON, SUMMARY_MD = "summary.json", "summary.md"


@dataclass(frozen=True)
class BenchConfig:
    """Everything that must match for two runs' records to be comparable (the question limit need not)."""

    task: str
    methods: tuple[str, ...]
    theta: float
    margin: str
    k: int
    max_new_tokens: int
    target: str
    draft: str
    draft_quant: str
    draft_confidence: float
    lookup: bool
    dtype: str
    threads: int
    tree: str | None = None  # the shape "+tree" methods draft, e.g. "2,2" (None in runs without one)
    prepack: bool = True  # oneDNN-prepacked linear layers (runs before this option had none)
    temperature: float = 0.0  # 0: greedy (runs before sampling was measured were all greedy)
    samples: int = 1  # decodes per question and method (more than 1 only makes sense when sampling)
    plain_limit: int | None = None  # plain runs on the first N questions only (None: on all)
    device: str = "cpu"  # where the models ran (runs before --device existed ran on the CPU)
    # A conversation's later turns keep the cache of its earlier ones (the first turn of every question
    # and method is always scored from scratch, so no method inherits another's prefill).
    prefix_reuse: bool = False
    target_quant: str = "none"  # "int8": the target's linear layers in int8 (runs before it had none)

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise MarspecError(f"--samples must be an integer >= 1, got {self.samples!r}")
        if self.samples > 1 and self.temperature == 0:
            raise MarspecError(
                "--samples > 1 needs --temperature > 0: greedy decoding gives the same output every time"
            )
        if self.plain_limit is not None and self.plain_limit < 1:
            raise MarspecError(f"--plain-limit must be >= 1, got {self.plain_limit}")

    @property
    def tree_shape(self) -> tuple[int, ...] | None:
        return parse_tree_shape(self.tree)


# Fields that may change between invocations on one directory: records are keyed by method, so adding a
# method reuses every record already there, and plain's question limit only decides where it runs.
ADDABLE_FIELDS = ("methods", "plain_limit")


def prepare_out_dir(out_dir: Path, config: BenchConfig) -> dict[RecordKey, dict]:
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


RecordKey = tuple[str, str, int]  # (question id, method, sample index)


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
    config, summary, _ = _read_whole_run(run_dir)
    return config, summary


def _read_whole_run(run_dir: Path) -> tuple[BenchConfig, dict[str, Any], dict[RecordKey, dict]]:
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
    qids = _summarized_qids(summary, records)
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


def load_records(out_dir: Path) -> dict[RecordKey, dict]:
    """Records by (question id, method, sample). A torn last line left by an interrupted run is cut off,
    so the next record starts on a line of its own."""
    records: dict[RecordKey, dict] = {}
    path = out_dir / RECORDS_FILE
    if not path.exists():
        return records
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[rec["qid"], rec["method"], rec.get("sample", 0)] = rec
    return records


def turn_record(out: TurnOutput) -> dict[str, Any]:
    s: GenerationStats = out.stats
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
        # Measured inside the forwards (prefill included), for every method: where the wall time went.
        "target_forward_s": s.target_forward_s,
        "draft_forward_s": s.draft_forward_s,
        # For the ideal time (marspec.profile); a peer's loop (hf-*) records no steps.
        "prefill_s": s.prefill_s if s.steps else None,
        "prompt_tokens": s.prompt_tokens,
        "reused_tokens": s.reused_tokens,  # prompt tokens kept cached from the conversation's last turn
        "verify_sizes": s.verify_sizes() if s.steps else None,
        "draft_forwards": s.draft_forwards,
        "hit_limit": out.hit_limit,
        "position_reached": reached,
        "position_accepted": accepted,
        "margins": {k: [round(v, 4) for v in vs] for k, vs in s.margins_by_outcome().items()},
        # What an audit of the output needs (marspec report --html): the tokens, and each relaxed one.
        "token_ids": out.token_ids,
        "relaxed": out.relaxed,
    }


def sample_seed(qid: str, sample: int, turn: int) -> int:
    """The seed of one sampled turn: the same for every method, different across questions, samples
    and turns, and stable across runs and machines."""
    digest = hashlib.sha256(f"{qid}|{sample}|{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits


@functools.cache
def cpu_name() -> str:
    """The processor, as precisely as the kernel names it: model name and, on x86, family, model and
    stepping (e.g. "AMD EPYC (family 26, model 2, stepping 1)"), or the platform's best guess."""
    guess = platform.processor() or platform.machine()
    try:
        return cpu_from_cpuinfo(Path("/proc/cpuinfo").read_text()) or guess
    except OSError:
        return guess


def cpu_from_cpuinfo(text: str) -> str | None:
    """The first processor of a /proc/cpuinfo listing, or None when it names none. Cloud machines often
    report a bare "AMD EPYC" or "Intel Xeon Processor" for several generations whose kernels round
    differently (a lossy rule's outputs then differ), so the generation's numbers are part of the name."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends here
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if name is None:
        return None
    labels = {"cpu family": "family", "model": "model", "stepping": "stepping"}
    generation = ", ".join(f"{label} {fields[key]}" for key, label in labels.items() if key in fields)
    return f"{name} ({generation})" if generation else name


def runs_on(method: str, index: int, config: BenchConfig) -> bool:
    """Whether ``method`` runs on the question at ``index`` (plain may be limited to the first few)."""
    return not (method == "plain" and config.plain_limit is not None and index >= config.plain_limit)


def planned_runs(questions: Sequence[Question], methods: Sequence[Method], config: BenchConfig) -> int:
    """How many (question, sample, method) decodes the run consists of."""
    return sum(config.samples for i in range(len(questions)) for m in methods if runs_on(m.name, i, config))


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
) -> dict[str, Any]:
    """Run (or resume) the benchmark and write its summary. ``grade(question, turn_texts)`` returns at
    least ``{"score": float | None}``; ``on_done(question, method, sample, skipped)`` reports progress.
    With ``redo_contended``, records decoded while other processes loaded the machine are decoded again,
    and with ``redo_other_cpu`` those decoded on another processor model than this machine's (a run
    resumed elsewhere), so every question's speed ratios come from one CPU. A new record is appended
    and supersedes the old one."""

    def redo(record: dict) -> bool:
        other_cpu = record.get("cpu") is not None and record["cpu"] != cpu_name()
        return (redo_contended and contended(record)) or (redo_other_cpu and other_cpu)

    records = prepare_out_dir(out_dir, config)
    with (out_dir / RECORDS_FILE).open("a") as sink:
        for index, question in enumerate(questions):
            for sample in range(config.samples):
                for method in methods:
                    if not runs_on(method.name, index, config):
                        continue
                    key = (question.qid, method.name, sample)
                    if key in records and not redo(records[key]):
                        if on_done:
                            on_done(question, method, sample, True)
                        continue
                    started = datetime.now(UTC).isoformat(timespec="seconds")
                    with LoadWatch() as load:
                        turns = _run_turns(decoder, method, question, sample, config)
                    rec = {
                        "qid": question.qid,
                        "method": method.name,
                        "sample": sample,
                        "theta": method.theta,
                        "margin": method.margin or config.margin,
                        "turns": [turn_record(t) for t in turns],
                        "seeds": [t.seed for t in turns],
                        # Runs resumed or extended on another machine mix CPUs (whose kernels round
                        # near-ties differently): each record says where it ran.
                        "cpu": cpu_name(),
                        "started": started,
                        "other_cores": load.other_cores,  # see marspec.eval.contention
                        **grade(question, [t.text for t in turns]),
                    }
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                    records[key] = rec
                    if on_done:
                        on_done(question, method, sample, False)
    return write_summary(out_dir, config, [m.name for m in methods], [q.qid for q in questions], records)


def write_summary(
    out_dir: Path,
    config: BenchConfig,
    methods: Sequence[str],
    qids: Sequence[str],
    records: dict[RecordKey, dict],
) -> dict[str, Any]:
    """Summarize ``records`` and write ``summary.json`` and ``summary.md`` into ``out_dir``."""
    summary = summarize(config, methods, qids, records, load_costs(out_dir))
    (out_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / SUMMARY_MD).write_text(summary_markdown(summary))
    return summary


def resummarize(run_dir: Path) -> dict[str, Any]:
    """Rewrite a whole run's summary from its records with this version's metrics, without loading a
    model or decoding anything (the records hold every measurement). The run's methods and questions
    are the ones its summary lists; a partial run is refused, as by :func:`whole_run`."""
    config, summary, records = _read_whole_run(run_dir)
    qids = _summarized_qids(summary, records)
    return write_summary(run_dir, config, list(summary["methods"]), qids, records)


def _summarized_qids(summary: dict[str, Any], records: dict[RecordKey, dict]) -> list[str]:
    # Summaries written before they listed their questions: the questions the records hold.
    return summary.get("qids") or list(dict.fromkeys(q for q, _, _ in records))


def load_costs(out_dir: Path) -> ForwardCosts | None:
    path = out_dir / PROFILE_FILE
    return ForwardCosts.from_dict(json.loads(path.read_text())) if path.exists() else None


def profile_once(decoder: Decoder, config: BenchConfig, out_dir: Path) -> ForwardCosts:
    """The forward-cost profile of this run's models (measured once; a resumed run keeps the first)."""
    costs = load_costs(out_dir)
    if costs is None:
        draft_lm = decoder.drafter.draft_model if decoder.drafter else None
        shape = config.tree_shape
        siblings = sum(width - 1 for width in shape) if shape else 0
        costs = profile_pair(decoder.target, draft_lm, max_tokens=config.k + 1 + siblings)
        (out_dir / PROFILE_FILE).write_text(json.dumps(costs.to_dict(), indent=2) + "\n")
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


def references(config: BenchConfig, methods: Sequence[str]) -> tuple[str, str]:
    """(speed baseline, quality reference) of a run: plain for speed when it ran; for quality plain when
    it ran on every question, else strict (plain's equal), else the first method."""
    speed = "plain" if "plain" in methods else methods[0]
    if "plain" in methods and config.plain_limit is None:
        return speed, "plain"
    return speed, "strict" if "strict" in methods else methods[0]


def summarize(
    config: BenchConfig,
    methods: Sequence[str],
    qids: Sequence[str],
    records: dict[RecordKey, dict],
    costs: ForwardCosts | None = None,
) -> dict[str, Any]:
    """Metrics per method over the questions every method has finished (so ratios compare like with
    like; plain, when limited, over its own first questions). With ``costs``, marspec's own methods
    also get ``achieved_vs_ideal``. Scores and recovery come with 95% bootstrap intervals."""
    index = {q: i for i, q in enumerate(qids)}
    samples = range(config.samples)

    def ran(q: str, m: str) -> bool:
        return runs_on(m, index[q], config)

    done = [q for q in qids if all((q, m, s) in records for m in methods if ran(q, m) for s in samples)]
    speed_base, quality_base = references(config, methods)
    by_q = {m: {q: [records[q, m, s] for s in samples] for q in done if ran(q, m)} for m in methods}
    quality_recs = by_q[quality_base]
    per_method: dict[str, dict[str, Any]] = {}
    scores: dict[str, dict[str, float | None]] = {}
    for m in methods:
        per_method[m], scores[m] = _method_metrics(by_q[m], quality_recs)
        per_method[m]["achieved_vs_ideal"] = _achieved_vs_ideal(
            [r for recs in by_q[m].values() for r in recs], costs
        )
    for m, metrics in per_method.items():
        metrics["speedup"], metrics["speed_questions"] = _speed_ratio(by_q[m], by_q[speed_base])
        if "strict" in by_q:
            # Against strict on every question both ran (plain may have run on a few only): the ratio a
            # calibration ranks settings by, whatever the run's speed baseline.
            metrics["speedup_vs_strict"], _ = _speed_ratio(by_q[m], by_q["strict"])
        paired = [
            q for q in by_q[m] if scores[m].get(q) is not None and scores[quality_base].get(q) is not None
        ]
        recovery = ratio_interval([scores[m][q] for q in paired], [scores[quality_base][q] for q in paired])
        metrics["recovery"] = recovery.value
        metrics["recovery_ci"] = [recovery.lo, recovery.hi] if recovery.lo is not None else None
    # Decodes per processor model (records from before records named it are left out).
    cpus = Counter(r["cpu"] for per_q in by_q.values() for recs in per_q.values() for r in recs if "cpu" in r)
    summary = {
        "config": asdict(config),
        "baseline": speed_base,
        "quality_reference": quality_base,
        "questions": len(done),
        "qids": list(done),
        "samples": config.samples,
        "cpus": dict(cpus),
        "methods": per_method,
    }
    if "strict" in methods and "plain" in methods:
        summary["strict_minus_plain"] = _strict_minus_plain(scores, by_q["plain"])
    if costs is not None and "plain" in methods:
        summary["one_token_step"] = _one_token_step(by_q["plain"], costs)
    return summary


def _one_token_step(plain_by_q: dict[str, list[dict]], costs: ForwardCosts) -> dict[str, Any] | None:
    """Plain's one-token target step as the run measured it (ms; median and range over questions)
    beside the profile's price for it. The profile is a snapshot taken once; a one-token step is bound
    by memory bandwidth, which on a shared machine drifts by question, so achieved/ideal is only as
    good as this agreement."""
    per_question = []
    for recs in plain_by_q.values():
        turns = [t for r in recs for t in r["turns"]]
        steps = sum(t["target_forwards"] - 1 for t in turns)  # every forward but the prefill
        if steps > 0:
            seconds = sum(t["target_forward_s"] - t["prefill_s"] for t in turns)
            per_question.append(1000 * seconds / steps)
    if not per_question:
        return None
    return {
        "profiled_ms": 1000 * costs.target_s(1),
        "median_ms": statistics.median(per_question),
        "min_ms": min(per_question),
        "max_ms": max(per_question),
    }


def _strict_minus_plain(scores: dict[str, dict[str, float | None]], plain_qs: dict[str, list]) -> dict | None:
    """Strict speculative decoding must equal plain decoding (token for token when greedy, in
    distribution when sampling): their score difference on the questions both ran, with its interval,
    and whether the interval excludes 0 (a red flag)."""
    qs = [q for q in plain_qs if scores["strict"].get(q) is not None and scores["plain"].get(q) is not None]
    if not qs:
        return None
    diff = difference_interval([scores["strict"][q] for q in qs], [scores["plain"][q] for q in qs])
    return {**diff.to_dict(), "questions": len(qs), "excludes_zero": not diff.contains(0.0)}


def _speed_ratio(own: dict[str, list[dict]], base: dict[str, list[dict]]) -> tuple[float | None, int]:
    """Mean tokens/s over mean tokens/s of ``base`` on the questions both ran, and how many those are."""
    common = [q for q in own if q in base]
    base_rate = _mean([_rate(base[q]) for q in common])
    rate = _mean([_rate(own[q]) for q in common])
    return (rate / base_rate if base_rate else None), len(common)


def _rate(recs: list[dict]) -> float:
    """A question's tokens per second: the mean over its samples of new tokens / wall time."""
    return _mean(
        [
            sum(t["new_tokens"] for t in r["turns"]) / max(1e-9, sum(t["wall_s"] for t in r["turns"]))
            for r in recs
        ]
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _method_metrics(
    by_q: dict[str, list[dict]], quality_by_q: dict[str, list[dict]]
) -> tuple[dict[str, Any], dict[str, float | None]]:
    """The metrics of one method's records (by question, each a list over samples) and its score per
    question (the mean over samples; for a task without a grader, chrF agreement with the quality
    reference's same sample)."""
    recs = [r for rs in by_q.values() for r in rs]
    turns = [t for r in recs for t in r["turns"]]
    tokens = sum(t["new_tokens"] for t in turns)
    forwards = sum(t["target_forwards"] for t in turns)
    wall = sum(t["wall_s"] for t in turns)
    exact = sum(t["accepted_exact"] for t in turns)
    relaxed = sum(t["accepted_relaxed"] for t in turns)
    drafted = sum(t["drafted"] for t in turns)
    reached, accepted = (
        _sum_lists([t["position_reached"] for t in turns]),
        _sum_lists([t["position_accepted"] for t in turns]),
    )
    graded = bool(recs) and any(r.get("score") is not None for r in recs)
    turn_agreement = None
    q_scores: dict[str, float | None] = {}
    pairs = [
        (r, b)
        for q, rs in by_q.items()
        if q in quality_by_q
        for r, b in zip(rs, quality_by_q[q], strict=True)
    ]
    if graded:
        for q, rs in by_q.items():
            values = [r.get("score") for r in rs]
            q_scores[q] = None if None in values else _mean([float(v) for v in values])
    elif pairs:
        # No task score (MT-Bench): agreement with the quality reference's text is the quality measure.
        per_pair = [
            agreement([t["text"] for t in r["turns"]], [t["text"] for t in b["turns"]]) for r, b in pairs
        ]
        n_turns = len(per_pair[0]["chrf"])
        turn_agreement = {
            "chrf_by_turn": [_mean([a["chrf"][i] for a in per_pair]) for i in range(n_turns)],
            "exact_by_turn": [_mean([a["exact"][i] for a in per_pair]) for i in range(n_turns)],
        }
        pair_scores = iter(sum(a["chrf"]) / len(a["chrf"]) / 100 for a in per_pair)
        for q, rs in by_q.items():
            if q in quality_by_q:
                q_scores[q] = _mean([next(pair_scores) for _ in rs])
    overheads = [t["overhead_s"] for t in turns if t["overhead_s"] is not None]
    same = sum(
        all(a["text"] == b["text"] for a, b in zip(r["turns"], b_r["turns"], strict=True)) for r, b_r in pairs
    )
    known = [v for v in q_scores.values() if v is not None]
    score: Estimate = (
        mean_interval(known) if known and len(known) == len(q_scores) else Estimate(None, None, None)
    )
    metrics = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": _mean([_rate(rs) for rs in by_q.values()]),
        "tau": (tokens + sum(t["stopped_at_eos"] for t in turns)) / forwards if forwards else None,
        "accepted_exact": exact,
        "accepted_relaxed": relaxed,
        "rejected": sum(t["rejected"] for t in turns),
        "drafted": drafted,
        "relaxed_share": relaxed / (exact + relaxed) if exact + relaxed else 0.0,
        "acceptance_by_position": [a / n for a, n in zip(accepted, reached, strict=True)],
        "overhead_share": sum(overheads) / wall if overheads and wall else None,
        "target_share": _share(turns, "target_forward_s", wall),
        "draft_share": _share(turns, "draft_forward_s", wall),
        "hit_limit": sum(t["hit_limit"] for t in turns),
        "contended": sum(contended(r) for r in recs),  # decodes timed on a busy machine
        "turns": len(turns),
        "questions": len(by_q),
        "decodes": len(recs),
        "same_as_baseline": same,
        "score": score.value,
        "score_ci": [score.lo, score.hi] if score.lo is not None else None,
        "agreement": turn_agreement,
    }
    return metrics, q_scores


def _share(turns: list[dict], key: str, wall: float) -> float | None:
    """Share of the wall time spent in one model's forwards (None for records written before it was
    kept)."""
    if not wall or any(key not in t for t in turns):
        return None
    return sum(t[key] for t in turns) / wall


def _achieved_vs_ideal(recs: list[dict], costs: ForwardCosts | None) -> float | None:
    """Ideal decode time (the recorded forwards at the profiled costs) over the measured decode time
    (wall minus prefill); 1.0 means the loop ran exactly as fast as its forwards allow."""
    turns = [t for r in recs for t in r["turns"]]
    if costs is None or not turns or any(t.get("verify_sizes") is None for t in turns):
        return None
    ideal = sum(ideal_seconds(t["verify_sizes"], t["draft_forwards"], costs) for t in turns)
    achieved = sum(t["wall_s"] - t["prefill_s"] for t in turns)
    return ideal / achieved if achieved > 0 else None


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for values in lists:
        out.extend([0] * (len(values) - len(out)))
        for i, v in enumerate(values):
            out[i] += v
    return out


def _target_quant(cfg: dict[str, Any]) -> str:
    quant = cfg.get("target_quant", "none")
    return "" if quant == "none" else f" ({quant})"


def _drafting(cfg: dict[str, Any]) -> str:
    """How the draft model drafted (absent from summaries written before these options existed)."""
    if cfg["draft"] in ("none", "ngram") or "draft_quant" not in cfg:
        return ""
    lookup = " + prompt lookup" if cfg["lookup"] else ""
    return f" ({cfg['draft_quant']}, confidence stop {cfg['draft_confidence']}{lookup})"


def _interval_text(value: float | None, ci: list[float] | None, spec: str) -> str:
    if value is None:
        return "—"
    text = format(value, spec)
    return text if ci is None else f"{text} [{format(ci[0], spec)}, {format(ci[1], spec)}]"


def summary_markdown(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    temperature = cfg.get("temperature", 0.0)
    samples = summary.get("samples", 1)
    decoding = "greedy" if not temperature else f"temperature {temperature:g}, {samples} samples per question"
    reference = summary.get("quality_reference", summary["baseline"])
    lines = [
        f"# {cfg['task']}: {summary['questions']} questions, {decoding}",
        "",
        f"target `{cfg['target']}`{_target_quant(cfg)}, "
        f"draft `{cfg['draft']}`{_drafting(cfg)}, {cfg['dtype']}"
        f"{', oneDNN-prepacked' if cfg.get('prepack') else ''}, "
        f"{cfg['threads']} threads, "
        f"k={cfg['k']}, theta={cfg['theta']} ({cfg['margin']}), max_new_tokens={cfg['max_new_tokens']}",
        "",
        f"Speedup is against {summary['baseline']}; score and recovery (against {reference}) carry 95% "
        "bootstrap intervals over questions.",
    ]
    if cfg.get("plain_limit"):
        lines.append(f"Plain ran on the first {cfg['plain_limit']} questions only (the speed baseline).")
    lines += [
        "",
        "| method | tok/s | speedup | tau | exact | relaxed | rejected | relaxed share | score [95% CI] "
        f"| recovery [95% CI] | same as {reference} | hit limit | draft share | overhead | achieved/ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Any, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    for name, m in summary["methods"].items():
        lines.append(
            f"| {name} | {m['tokens_per_s']:.2f} | {fmt(m['speedup'], '.2f')}x | {fmt(m['tau'], '.2f')} "
            f"| {m['accepted_exact']} | {m['accepted_relaxed']} | {m['rejected']} | {m['relaxed_share']:.1%} "
            f"| {_interval_text(m['score'], m.get('score_ci'), '.3f')} "
            f"| {_interval_text(m['recovery'], m.get('recovery_ci'), '.1%')} "
            f"| {m['same_as_baseline']}/{m.get('decodes', summary['questions'])} "
            f"| {m['hit_limit']}/{m['turns']} | {fmt(m['draft_share'], '.1%')} "
            f"| {fmt(m['overhead_share'], '.1%')} "
            f"| {fmt(m.get('achieved_vs_ideal'), '.1%')} |"
        )
    busy = {name: m["contended"] for name, m in summary["methods"].items() if m.get("contended")}
    if busy:
        counts = ", ".join(f"{name} {n}" for name, n in busy.items())
        lines += [
            "",
            f"**Timings suspect**: decodes made while other processes used more than {CONTENDED_CORES:g} "
            f"of a core ({counts}). Their speed is not comparable; `marspec bench ... --redo-contended` "
            "decodes them again.",
        ]
    cpus = summary.get("cpus", {})
    if len(cpus) > 1:
        counts = ", ".join(f"{name} {n}" for name, n in cpus.items())
        lines += [
            "",
            f"**Decoded on {len(cpus)} processor models** ({counts}): a speed ratio between decodes on "
            "different CPUs is not a measurement, and a lossy rule's drafts differ by CPU. "
            "`marspec bench ... --redo-other-cpu` decodes the others' records again on this machine.",
        ]
    step = summary.get("one_token_step")
    if step is not None:
        lines += [
            "",
            f"Plain's one-token target step took {step['median_ms']:.0f} ms (median over questions; "
            f"{step['min_ms']:.0f}-{step['max_ms']:.0f}); the profile priced it at "
            f"{step['profiled_ms']:.0f} ms. "
            "Achieved/ideal is read against that one snapshot of the machine's speed.",
        ]
    check = summary.get("strict_minus_plain")
    if check is not None and check["value"] is not None:
        verdict = (
            "**the interval excludes 0: strict and plain differ, which lossless verification must not**"
            if check["excludes_zero"]
            else "the interval includes 0, as lossless verification requires"
        )
        lines += [
            "",
            f"Strict minus plain score on the {check['questions']} questions both ran: "
            f"{check['value']:+.3f} [{check['lo']:+.3f}, {check['hi']:+.3f}]; {verdict}.",
        ]
    return "\n".join(lines) + "\n"
