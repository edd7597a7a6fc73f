"""Plots of a benchmark directory: speed and quality against theta, acceptance by draft position, and
where the logit ratio r falls for exact, relaxed and rejected draft tokens."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from marspec.errors import MarspecError
from marspec.eval.method_names import REFERENCE, RUN_MARS
from marspec.eval.rundir import SUMMARY_JSON, load_records, whole_run


def make_report(out_dir: Path) -> list[Path]:
    """Write the PNGs for the run in ``out_dir``; return their paths."""
    summary_path = out_dir / SUMMARY_JSON
    if not summary_path.exists():
        raise MarspecError(f"{out_dir} has no {SUMMARY_JSON}: run `marspec bench --out {out_dir}` first")
    summary = json.loads(summary_path.read_text())
    written = [_acceptance_by_position(summary, out_dir), _margin_histogram(summary, out_dir)]
    for optional in (_theta_curve(summary, out_dir), _pareto(summary, out_dir)):
        if optional is not None:
            written.append(optional)
    return written


def _title(summary: dict) -> str:
    cfg = summary["config"]
    temperature = cfg.get("temperature", 0.0)
    decoding = "greedy" if not temperature else f"T={temperature:g} x{summary.get('samples', 1)}"
    return f"{cfg['task']} · {summary['questions']} questions · {decoding} · k={cfg['k']} · {cfg['dtype']}"


def _save(fig: plt.Figure, ax: plt.Axes, title: str, path: Path) -> Path:
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _theta_of(name: str, default: float) -> float | None:
    if name == REFERENCE:
        return 1.0
    if name == RUN_MARS:
        return default
    if name.startswith("mars@"):
        return float(name.split("@", 1)[1])
    return None


def _family(name: str) -> str:
    """The curve a method belongs to on the Pareto plot: its rule and margin, without the setting."""
    base, _, suffix = name.partition("+")
    return base.split("@", 1)[0] + (f"+{suffix}" if suffix else "")


def _setting(name: str) -> float:
    """A method's theta, for ordering a curve's points (0 when it has none)."""
    value = name.partition("+")[0].partition("@")[2]
    try:
        return float(value)
    except ValueError:
        return 0.0


def _pareto(summary: dict, out_dir: Path) -> Path | None:
    return _plot_pareto(
        summary["methods"],
        reference=summary.get("quality_reference", summary["baseline"]),
        baseline=summary["baseline"],
        title="Speed against quality\n" + _title(summary),
        path=out_dir / "pareto.png",
    )


def combined_pareto(runs: Sequence[Path], path: Path) -> Path:
    """One Pareto plot over several whole runs of one task on the same questions (e.g. a MARS sweep and
    a run of rival rules): each method's speedup is over its own run's baseline, so the runs must share
    the baseline, the quality reference and the decoding settings. A method in several runs is drawn from
    the first run listed."""
    if len(runs) < 2:
        raise MarspecError("--combined needs at least two runs to put on one plot")
    summaries = [whole_run(run)[1] for run in runs]
    first = summaries[0]
    shared = ("task", "temperature", "k", "dtype", "max_new_tokens", "target", "draft")
    for run, summary in zip(runs[1:], summaries[1:], strict=True):
        differing = [f for f in shared if summary["config"].get(f) != first["config"].get(f)]
        for key in ("baseline", "quality_reference", "questions", "samples"):
            if summary.get(key) != first.get(key):
                differing.append(key)
        if first.get("qids") and summary.get("qids") and summary["qids"] != first["qids"]:
            differing.append("qids")
        if differing:
            raise MarspecError(
                f"{run} cannot share a plot with {runs[0]}: they differ in {', '.join(differing)}"
            )
    methods: dict[str, dict] = {}
    for summary in summaries:
        for name, metrics in summary["methods"].items():
            methods.setdefault(name, metrics)
    baseline = first["baseline"]
    plotted = _plot_pareto(
        methods,
        reference=first.get("quality_reference", baseline),
        baseline=f"{baseline} (each run's own)",
        title=f"Speed against quality, {len(runs)} runs\n" + _title(first),
        path=path,
    )
    if plotted is None:
        raise MarspecError(f"{', '.join(map(str, runs))} hold fewer than two methods with a recovery")
    return plotted


def _plot_pareto(
    methods: dict[str, dict], *, reference: str, baseline: str, title: str, path: Path
) -> Path | None:
    """Speedup against recovery, with recovery's 95% interval as error bars: one curve per rule and
    margin, the reference (recovery 100% by definition) and the peers as single points."""
    points = [
        (name, m["recovery"], m.get("recovery_ci"), m["speedup"])
        for name, m in methods.items()
        if m.get("recovery") is not None and m.get("speedup") is not None
    ]
    if len(points) < 2:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    families: dict[str, list] = {}
    for point in points:
        families.setdefault(_family(point[0]), []).append(point)
    for family, members in families.items():
        members.sort(key=lambda p: _setting(p[0]))  # a curve traced along theta
        xs = [100 * p[1] for p in members]
        ys = [p[3] for p in members]
        errors = [
            [100 * (p[1] - p[2][0]) if p[2] else 0 for p in members],
            [100 * (p[2][1] - p[1]) if p[2] else 0 for p in members],
        ]
        line = ax.errorbar(
            xs, ys, xerr=errors, fmt="o-" if len(members) > 1 else "s", capsize=3, label=family
        )
        for name, x, y in zip([p[0] for p in members], xs, ys, strict=True):
            setting = name.partition("+")[0].partition("@")[2]
            if setting:
                ax.annotate(
                    setting,
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=line[0].get_color(),
                )
    ax.axvline(100, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(f"recovery vs {reference} (%), 95% bootstrap interval")
    ax.set_ylabel(f"speedup over {baseline} (x)")
    ax.legend(fontsize=8)
    return _save(fig, ax, title, path)


def _theta_curve(summary: dict, out_dir: Path) -> Path | None:
    """Speedup and recovery against theta (strict is theta = 1), when the run has several thetas."""
    points = sorted(
        (theta, m["speedup"], m["recovery"])
        for name, m in summary["methods"].items()
        if (theta := _theta_of(name, summary["config"]["theta"])) is not None and m["speedup"] is not None
    )
    if len(points) < 3:
        return None
    thetas, speedups, recoveries = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(thetas, speedups, "o-", color="tab:blue", label="speedup over plain")
    ax.set_xlabel(f"theta on the {summary['config']['margin']} (1.0 = strict)")
    ax.set_ylabel("speedup (x)", color="tab:blue")
    if all(r is not None for r in recoveries):
        ax2 = ax.twinx()
        ax2.plot(thetas, [100 * r for r in recoveries], "s--", color="tab:red", label="accuracy recovery")
        ax2.set_ylabel("recovery (%)", color="tab:red")
    return _save(fig, ax, "MARS speed/quality trade-off\n" + _title(summary), out_dir / "theta_sweep.png")


def _acceptance_by_position(summary: dict, out_dir: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, m in summary["methods"].items():
        rates = m["acceptance_by_position"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, "o-", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (of steps that drafted that far)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    return _save(
        fig, ax, "Acceptance by draft position\n" + _title(summary), out_dir / "acceptance_by_position.png"
    )


def _margin_histogram(summary: dict, out_dir: Path) -> Path:
    """Distribution of the margin measure (logit ratio r by default) by outcome, for the MARS method
    with the lowest theta (the one that relaxes most)."""
    mars = [n for n in summary["methods"] if _theta_of(n, summary["config"]["theta"]) not in (None, 1.0)]
    name = min(mars, key=lambda n: _theta_of(n, summary["config"]["theta"])) if mars else REFERENCE
    groups: dict[str, list[float]] = {"exact": [], "relaxed": [], "rejected": []}
    for (_, method, _), rec in load_records(out_dir).items():
        if method == name:
            for turn in rec["turns"]:
                for outcome, values in turn["margins"].items():
                    groups[outcome].extend(v for v in values if v == v and abs(v) != float("inf"))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bins = [i / 50 for i in range(-10, 51)]  # r in [-0.2, 1.0]
    for outcome, color in (("exact", "tab:green"), ("relaxed", "tab:orange"), ("rejected", "tab:red")):
        values = [min(max(v, -0.2), 1.0) for v in groups[outcome]]
        if values:
            ax.hist(
                values, bins=bins, alpha=0.55, color=color, label=f"{outcome} ({len(values)})", density=True
            )
    theta = _theta_of(name, summary["config"]["theta"])
    if theta is not None:
        ax.axvline(theta, color="black", linestyle=":", label=f"theta = {theta}")
    ax.set_xlabel(f"{summary['config']['margin']} at the draft position")
    ax.set_ylabel("density")
    ax.legend()
    title = f"Margin at verified draft positions ({name})\n" + _title(summary)
    return _save(fig, ax, title, out_dir / "margin_distribution.png")
