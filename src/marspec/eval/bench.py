"""The side-by-side benchmark: every method on the same questions, in one process, interleaved.

Results stream to ``DIR/records.jsonl`` (one line per question and method), so an interrupted run
resumes where it stopped; ``DIR/config.json`` guards against mixing configurations; ``summary.json``
and ``summary.md`` hold the metrics of SPEC ("What is measured").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from marspec.api import Decoder
from marspec.errors import MarspecError
from marspec.eval.datasets import Question
from marspec.eval.grading import Grader, agreement
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

    @property
    def tree_shape(self) -> tuple[int, ...] | None:
        return parse_tree_shape(self.tree)


def prepare_out_dir(out_dir: Path, config: BenchConfig) -> dict[tuple[str, str], dict]:
    """Create ``out_dir`` or check it holds the same configuration; return the records already there."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / CONFIG_FILE
    wanted = asdict(config)
    wanted["methods"] = list(config.methods)
    if config_path.exists():
        have = json.loads(config_path.read_text())
        diff = sorted(k for k in set(have) | set(wanted) if have.get(k) != wanted.get(k))
        if diff:
            detail = "; ".join(f"{k}: {have.get(k)!r} there, {wanted.get(k)!r} now" for k in diff)
            raise MarspecError(
                f"{out_dir} holds results of a different configuration ({detail}); refusing to mix them: "
                "use another --out directory or delete this one"
            )
    else:
        config_path.write_text(json.dumps(wanted, indent=2) + "\n")
    return load_records(out_dir)


def load_records(out_dir: Path) -> dict[tuple[str, str], dict]:
    """Records by (question id, method). A torn last line left by an interrupted run is cut off, so the
    next record starts on a line of its own."""
    records: dict[tuple[str, str], dict] = {}
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
        records[rec["qid"], rec["method"]] = rec
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
        "verify_sizes": s.verify_sizes() if s.steps else None,
        "draft_forwards": s.draft_forwards,
        "hit_limit": out.hit_limit,
        "position_reached": reached,
        "position_accepted": accepted,
        "margins": {k: [round(v, 4) for v in vs] for k, vs in s.margins_by_outcome().items()},
    }


def run_bench(
    decoder: Decoder,
    questions: Sequence[Question],
    methods: Sequence[Method],
    config: BenchConfig,
    out_dir: Path,
    grade: Grader,
    on_done: Callable[[Question, Method, bool], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the benchmark and write its summary. ``grade(question, turn_texts)`` returns at
    least ``{"score": float | None}``; ``on_done(question, method, skipped)`` reports progress."""
    records = prepare_out_dir(out_dir, config)
    with (out_dir / RECORDS_FILE).open("a") as sink:
        for question in questions:
            for method in methods:
                if (question.qid, method.name) in records:
                    if on_done:
                        on_done(question, method, True)
                    continue
                turns = _run_turns(decoder, method, question, config)
                rec = {
                    "qid": question.qid,
                    "method": method.name,
                    "theta": method.theta,
                    "turns": [turn_record(t) for t in turns],
                    **grade(question, [t.text for t in turns]),
                }
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                records[question.qid, method.name] = rec
                if on_done:
                    on_done(question, method, False)
    qids = [q.qid for q in questions]
    summary = summarize(config, [m.name for m in methods], qids, records, load_costs(out_dir))
    (out_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / SUMMARY_MD).write_text(summary_markdown(summary))
    return summary


def load_costs(out_dir: Path) -> ForwardCosts | None:
    path = out_dir / PROFILE_FILE
    return ForwardCosts.from_dict(json.loads(path.read_text())) if path.exists() else None


def profile_once(decoder: Decoder, config: BenchConfig, out_dir: Path) -> ForwardCosts:
    """The forward-cost profile of this run's models (measured once; a resumed run keeps the first)."""
    costs = load_costs(out_dir)
    if costs is None:
        draft_lm = getattr(decoder.drafter, "lm", None)
        shape = config.tree_shape
        siblings = sum(width - 1 for width in shape) if shape else 0
        costs = profile_pair(decoder.target, draft_lm, max_tokens=config.k + 1 + siblings)
        (out_dir / PROFILE_FILE).write_text(json.dumps(costs.to_dict(), indent=2) + "\n")
    return costs


def _run_turns(decoder: Decoder, method: Method, question: Question, config: BenchConfig) -> list[TurnOutput]:
    """Multi-turn questions continue the method's own conversation, as a user of that method would."""
    messages: list[dict[str, str]] = []
    outputs = []
    for user_turn in question.turns:
        messages.append({"role": "user", "content": user_turn})
        out = run_method(
            decoder,
            method,
            messages,
            k=config.k,
            max_new_tokens=config.max_new_tokens,
            margin=config.margin,
            tree=config.tree_shape,
        )
        messages.append({"role": "assistant", "content": out.text})
        outputs.append(out)
    return outputs


def summarize(
    config: BenchConfig,
    methods: Sequence[str],
    qids: Sequence[str],
    records: dict[tuple[str, str], dict],
    costs: ForwardCosts | None = None,
) -> dict[str, Any]:
    """Metrics per method over the questions every method has finished (so ratios compare like with
    like). With ``costs``, marspec's own methods also get ``achieved_vs_ideal``."""
    done = [q for q in qids if all((q, m) in records for m in methods)]
    base = "plain" if "plain" in methods else methods[0]
    per_method: dict[str, dict[str, Any]] = {}
    for m in methods:
        recs = [records[q, m] for q in done]
        base_recs = [records[q, base] for q in done]
        per_method[m] = _method_metrics(recs, base_recs)
        per_method[m]["achieved_vs_ideal"] = _achieved_vs_ideal(recs, costs)
    base_rate = per_method[base]["tokens_per_s"] if done else 0.0
    base_score = per_method[base]["score"] if done else None
    for metrics in per_method.values():
        metrics["speedup"] = metrics["tokens_per_s"] / base_rate if base_rate else None
        score = metrics["score"]
        metrics["recovery"] = score / base_score if (score is not None and base_score) else None
    return {"config": asdict(config), "baseline": base, "questions": len(done), "methods": per_method}


def _method_metrics(recs: list[dict], base_recs: list[dict]) -> dict[str, Any]:
    turns = [t for r in recs for t in r["turns"]]
    tokens = sum(t["new_tokens"] for t in turns)
    forwards = sum(t["target_forwards"] for t in turns)
    wall = sum(t["wall_s"] for t in turns)
    exact = sum(t["accepted_exact"] for t in turns)
    relaxed = sum(t["accepted_relaxed"] for t in turns)
    drafted = sum(t["drafted"] for t in turns)
    # Spec-Bench speedup numerator: the per-question mean of tokens / wall time.
    rates = [
        sum(t["new_tokens"] for t in r["turns"]) / max(1e-9, sum(t["wall_s"] for t in r["turns"]))
        for r in recs
    ]
    reached, accepted = (
        _sum_lists([t["position_reached"] for t in turns]),
        _sum_lists([t["position_accepted"] for t in turns]),
    )
    scores = [r.get("score") for r in recs]
    turn_agreement = None
    if scores and all(s is None for s in scores):
        # No task score (MT-Bench): agreement with the baseline's text is the quality measure.
        per_q = [
            agreement([t["text"] for t in r["turns"]], [t["text"] for t in b["turns"]])
            for r, b in zip(recs, base_recs, strict=True)
        ]
        n_turns = len(per_q[0]["chrf"])
        turn_agreement = {
            "chrf_by_turn": [sum(a["chrf"][i] for a in per_q) / len(per_q) for i in range(n_turns)],
            "exact_by_turn": [sum(a["exact"][i] for a in per_q) / len(per_q) for i in range(n_turns)],
        }
        scores = [sum(a["chrf"]) / len(a["chrf"]) / 100 for a in per_q]
    overheads = [t["overhead_s"] for t in turns if t["overhead_s"] is not None]
    same = sum(
        all(a["text"] == b["text"] for a, b in zip(r["turns"], b_r["turns"], strict=True))
        for r, b_r in zip(recs, base_recs, strict=True)
    )
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": sum(rates) / len(rates) if rates else 0.0,
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
        "turns": len(turns),
        "same_as_baseline": same,
        "score": sum(scores) / len(scores) if scores and None not in scores else None,
        "agreement": turn_agreement,
    }


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


def _drafting(cfg: dict[str, Any]) -> str:
    """How the draft model drafted (absent from summaries written before these options existed)."""
    if cfg["draft"] in ("none", "ngram") or "draft_quant" not in cfg:
        return ""
    lookup = " + prompt lookup" if cfg["lookup"] else ""
    return f" ({cfg['draft_quant']}, confidence stop {cfg['draft_confidence']}{lookup})"


def summary_markdown(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    lines = [
        f"# {cfg['task']}: {summary['questions']} questions",
        "",
        f"target `{cfg['target']}`, draft `{cfg['draft']}`{_drafting(cfg)}, {cfg['dtype']}"
        f"{', oneDNN-prepacked' if cfg.get('prepack') else ''}, "
        f"{cfg['threads']} threads, "
        f"k={cfg['k']}, theta={cfg['theta']} ({cfg['margin']}), max_new_tokens={cfg['max_new_tokens']}",
        "",
        "| method | tok/s | speedup | tau | exact | relaxed | rejected | relaxed share | score | recovery "
        f"| same as {summary['baseline']} | hit limit | draft share | overhead | achieved/ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Any, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    for name, m in summary["methods"].items():
        lines.append(
            f"| {name} | {m['tokens_per_s']:.2f} | {fmt(m['speedup'], '.2f')}x | {fmt(m['tau'], '.2f')} "
            f"| {m['accepted_exact']} | {m['accepted_relaxed']} | {m['rejected']} | {m['relaxed_share']:.1%} "
            f"| {fmt(m['score'], '.3f')} | {fmt(m['recovery'], '.1%')} | {m['same_as_baseline']}/"
            f"{summary['questions']} | {m['hit_limit']}/{m['turns']} | {fmt(m['draft_share'], '.1%')} "
            f"| {fmt(m['overhead_share'], '.1%')} "
            f"| {fmt(m.get('achieved_vs_ideal'), '.1%')} |"
        )
    return "\n".join(lines) + "\n"
