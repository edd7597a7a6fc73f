"""A benchmark summary as markdown (``summary.md``): the settings, one table row per method, and the
warnings a reader needs (timings taken on a busy machine or on several CPUs, strict differing from plain).
"""

from __future__ import annotations

from typing import Any

from marspec.eval.contention import CONTENDED_CORES


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


def _counts(summary: dict[str, Any], field: str) -> str:
    """``method n, ...`` for the methods whose ``field`` is not zero (empty when none's is)."""
    return ", ".join(f"{name} {m[field]}" for name, m in summary["methods"].items() if m.get(field))


def summary_markdown(summary: dict[str, Any]) -> str:
    """The summary as markdown: its settings, the methods' table, then each note that applies."""
    lines = [*_settings(summary), *_table(summary)]
    for note in (_contended, _several_cpus, _timed_apart, _one_token_step, _strict_against_plain):
        paragraph = note(summary)
        if paragraph is not None:
            lines += ["", paragraph]
    return "\n".join(lines) + "\n"


def _settings(summary: dict[str, Any]) -> list[str]:
    """The title, the run's settings and what the intervals mean."""
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
    return lines


def _optional(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _table(summary: dict[str, Any]) -> list[str]:
    """The methods' table, one row per method, after a blank line."""
    reference = summary.get("quality_reference", summary["baseline"])
    lines = [
        "",
        "| method | tok/s | speedup | tau | exact | relaxed | rejected | relaxed share | score [95% CI] "
        f"| recovery [95% CI] | same as {reference} | hit limit | draft share | overhead | achieved/ideal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary["methods"].items():
        speedup = "—" if m["speedup"] is None else f"{m['speedup']:.2f}x"
        lines.append(
            f"| {name} | {m['tokens_per_s']:.2f} | {speedup} | {_optional(m['tau'], '.2f')} "
            f"| {m['accepted_exact']} | {m['accepted_relaxed']} | {m['rejected']} | {m['relaxed_share']:.1%} "
            f"| {_interval_text(m['score'], m.get('score_ci'), '.3f')} "
            f"| {_interval_text(m['recovery'], m.get('recovery_ci'), '.1%')} "
            f"| {m['same_as_baseline']}/{m.get('decodes', summary['questions'])} "
            f"| {m['hit_limit']}/{m['turns']} | {_optional(m['draft_share'], '.1%')} "
            f"| {_optional(m['overhead_share'], '.1%')} "
            f"| {_optional(m.get('achieved_vs_ideal'), '.1%')} |"
        )
    return lines


def _contended(summary: dict[str, Any]) -> str | None:
    busy = _counts(summary, "contended")
    if not busy:
        return None
    return (
        f"**Timings suspect**: decodes made while other processes used more than {CONTENDED_CORES:g} "
        f"of a core ({busy}). Their speed is not comparable; `marspec bench ... --redo-contended` "
        "decodes them again."
    )


def _several_cpus(summary: dict[str, Any]) -> str | None:
    cpus = summary.get("cpus", {})
    if len(cpus) <= 1:
        return None
    machines = ", ".join(f"{name} {n}" for name, n in cpus.items())
    unpaired = _counts(summary, "speed_unpaired")
    left_out = (
        f" Left out of speed, for want of a baseline decoded on their CPU ({unpaired} questions): "
        "`marspec bench --methods <baseline>,<them> ... --redo-apart` decodes them here together."
        if unpaired
        else ""
    )
    return (
        f"**Decoded on {len(cpus)} processor models** ({machines}): "
        "each speed ratio sets a decode against the baseline's decode on the same CPU model (a ratio "
        "across two machines measures the machines), and a lossy rule's drafts, hence its answers, "
        "differ by CPU." + left_out
    )


def _timed_apart(summary: dict[str, Any]) -> str | None:
    apart = _counts(summary, "speed_apart")
    if not apart:
        return None
    return (
        f"**Speed timed in different sittings** ({apart} questions): a decode and the baseline's it is "
        "set against started more than an hour apart (a baseline decoded again later), and a "
        "machine's speed moves by a few percent between sittings. Only back-to-back ratios are "
        "measurements at that level: `marspec bench ... --redo-apart` decodes them again together."
    )


def _one_token_step(summary: dict[str, Any]) -> str | None:
    step = summary.get("one_token_step")
    if step is None:
        return None
    return (
        f"Plain's one-token target step took {step['median_ms']:.0f} ms (median over questions; "
        f"{step['min_ms']:.0f}-{step['max_ms']:.0f}); the profile priced it at "
        f"{step['profiled_ms']:.0f} ms. "
        "Achieved/ideal is read against that one snapshot of the machine's speed."
    )


def _strict_against_plain(summary: dict[str, Any]) -> str | None:
    check = summary.get("strict_minus_plain")
    if check is None or check["value"] is None:
        return None
    verdict = (
        "**the interval excludes 0: strict and plain differ, which lossless verification must not**"
        if check["excludes_zero"]
        else "the interval includes 0, as lossless verification requires"
    )
    return (
        f"Strict minus plain score on the {check['questions']} questions both ran: "
        f"{check['value']:+.3f} [{check['lo']:+.3f}, {check['hi']:+.3f}]; {verdict}."
    )
