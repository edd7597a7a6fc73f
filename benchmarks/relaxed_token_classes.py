"""Which classes of relaxed tokens start the divergences that lose answers, from committed greedy runs.

For every lossy method's answer in the runs given (greedy, each with strict as its quality reference),
the first token where the answer differs from strict's is found. In a greedy fp32 run that token is a
relaxed accept (where it is not, the divergence is counted apart). Its class and the class of the
target's top-1 it replaced (:func:`marspec.token_classes.token_class`, decided from the token's text
alone, as the ``class`` guard decides it) are tallied by what the answer's score did against strict's:
lost, won, or the same (harmless). A second table gives the share of all relaxed accepts in each class:
what a guard that refuses a class gives up in speed.

An answer is counted once per (task, question, method): a method in several runs (MARS's default is in
the sweep and the rivals runs) is taken from the first run listed.

    PYTHONPATH=src python benchmarks/relaxed_token_classes.py docs/results/greedy-humaneval-100 \\
        docs/results/greedy-gsm8k-50 docs/results/rivals-greedy-humaneval-30 \\
        docs/results/rivals-greedy-gsm8k-30 docs/results/sweep-greedy-humaneval-30 \\
        docs/results/sweep-greedy-gsm8k-30

Prints markdown tables (docs/rules.md, "Which relaxed tokens break answers"). Loads only the target's
tokenizer from the model cache.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from _common import script_parser  # this folder's shared helpers

from marspec.defaults import GUARD_CLASSES
from marspec.errors import MarspecError
from marspec.eval.audit import NOT_AUDITED, _target_tokenizer
from marspec.eval.rundir import load_records, read_run
from marspec.token_classes import CLASSES, token_class

OUTCOMES = ("lost", "won", "same")


def first_divergence(ids: list[int], ref_ids: list[int]) -> int | None:
    """The first position where two token sequences differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ids, ref_ids, strict=False)):
        if a != b:
            return i
    return None if len(ids) == len(ref_ids) else min(len(ids), len(ref_ids))


def outcome(score: float, ref_score: float) -> str:
    return "lost" if score < ref_score else "won" if score > ref_score else "same"


def tally(runs: list[Path]) -> dict[str, Any]:
    """Per task: first divergences by (draft class, replaced class, outcome), and all relaxed accepts by
    class."""
    seen: set[tuple[str, str, str]] = set()
    tokenizers: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for run in runs:
        config, summary = read_run(run)
        if config.get("temperature"):
            raise MarspecError(f"{run} is sampled: the first divergence is a relaxed token only when greedy")
        task = config["task"]
        tok = tokenizers.setdefault(config["target"], _target_tokenizer(config["target"]))
        reference = summary.get("quality_reference") or "strict"
        records = load_records(run)
        per_task = out.setdefault(
            task,
            {"first": Counter(), "all": Counter(), "unrelaxed": Counter(), "untracked": 0, "guard_kept": 0},
        )
        for (qid, method, sample), rec in records.items():
            if sample or method in NOT_AUDITED or method == reference or (task, qid, method) in seen:
                continue
            ref = records.get((qid, reference, 0))
            if ref is None or rec.get("score") is None or ref.get("score") is None:
                continue
            turn, ref_turn = rec["turns"][0], ref["turns"][0]
            if turn.get("token_ids") is None or ref_turn.get("token_ids") is None:
                per_task["untracked"] += 1  # a run older than token ids in records
                continue
            seen.add((task, qid, method))
            relaxed = {int(pos): (int(t), int(top1)) for pos, t, top1, _ in turn.get("relaxed") or []}
            for t, top1 in relaxed.values():
                cls = token_class(tok.decode([t]))
                per_task["all"][cls] += 1
                per_task["guard_kept"] += (
                    cls in GUARD_CLASSES and token_class(tok.decode([top1])) in GUARD_CLASSES
                )
            at = first_divergence(turn["token_ids"], ref_turn["token_ids"])
            if at is None:
                continue
            result = outcome(rec["score"], ref["score"])
            if at not in relaxed:
                per_task["unrelaxed"][result] += 1
                continue
            draft, top1 = relaxed[at]
            per_task["first"][
                (token_class(tok.decode([draft])), token_class(tok.decode([top1])), result)
            ] += 1
    return out


def _row(name: str, counts: Counter) -> str:
    n = sum(counts.values())
    lost = counts["lost"]
    share = f"{100 * lost / n:.0f}%" if n else "-"
    return f"| {name} | {n} | {lost} | {counts['won']} | {counts['same']} | {share} |"


def render(result: dict[str, Any]) -> str:
    lines = []
    for task, data in result.items():
        first: Counter = data["first"]
        by_draft: dict[str, Counter] = {c: Counter() for c in CLASSES}
        by_top1: dict[str, Counter] = {c: Counter() for c in CLASSES}
        same_class: dict[bool, Counter] = {True: Counter(), False: Counter()}
        guard_passes: dict[bool, Counter] = {True: Counter(), False: Counter()}
        for (draft, top1, res), n in first.items():
            by_draft[draft][res] += n
            by_top1[top1][res] += n
            same_class[draft == top1][res] += n
            guard_passes[draft in GUARD_CLASSES and top1 in GUARD_CLASSES][res] += n
        head = (
            "| class | first divergences | lost | won | same score | lost share |\n|---|---|---|---|---|---|"
        )
        lines += [f"### {task}: the relaxed (draft) token at the first divergence", "", head]
        lines += [_row(c, by_draft[c]) for c in CLASSES if by_draft[c]]
        lines += [_row("**all**", sum(by_draft.values(), Counter()))]
        lines += ["", f"### {task}: the target's top-1 it replaced", "", head]
        lines += [_row(c, by_top1[c]) for c in CLASSES if by_top1[c]]
        lines += ["", f"### {task}: draft and top-1 of the same class or not", "", head]
        lines += [_row("same class", same_class[True]), _row("different classes", same_class[False])]
        lines += ["", f"### {task}: the class guard ({', '.join(GUARD_CLASSES)}) on both tokens", "", head]
        lines += [_row("guard lets it relax", guard_passes[True]), _row("guard refuses", guard_passes[False])]
        unrelaxed = data["unrelaxed"]
        lines += [
            "",
            f"Divergences not at a relaxed token: {sum(unrelaxed.values())} ({dict(unrelaxed)}); answers "
            f"without token ids (older records, skipped): {data['untracked']}.",
        ]
        total = sum(data["all"].values())
        lines += [
            "",
            f"Relaxed accepts the class guard would keep (both tokens of its classes): {data['guard_kept']} "
            f"of {total}.",
        ]
        lines += [
            "",
            f"### {task}: all relaxed accepts by class ({total})",
            "",
            "| class | share |",
            "|---|---|",
        ]
        lines += [f"| {c} | {100 * data['all'][c] / total:.0f}% |" for c in CLASSES if data["all"][c]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="greedy benchmark run folders")
    args = parser.parse_args(argv)
    try:
        print(render(tally(args.runs)))
    except MarspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
