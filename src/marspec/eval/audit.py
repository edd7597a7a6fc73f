"""The audit page: what a lossy rule changed in a benchmark run, token by token, in one HTML file.

For every question and every lossy method (MARS or a rival rule) the page shows the method's output
beside the quality reference's (plain, or strict where plain did not run on every question), with each
relaxed token highlighted (hovering shows the target's own top choice there and the margin), the first
token that differs from the reference marked, and pass/fail for both. A table on top sums it up per
method: relaxations per 1,000 tokens, answers changed, broken and fixed, and which kinds of token were
relaxed. It reads the records ``marspec bench`` writes (each turn's ``token_ids`` and ``relaxed``); runs
made before those were recorded get the outputs and scores without highlights.

The file is self-contained (inline CSS, a few lines of script that count what the page shows), so it
can be committed, mailed or opened from disk.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marspec.eval.rundir import load_records, read_run
from marspec.token_classes import AUDIT_KIND
from marspec.token_classes import token_class as fine_class

AUDIT_FILE = "audit.html"
TOKEN_CLASSES = ("identifier", "number", "punctuation", "whitespace", "word")
NOT_AUDITED = ("plain", "strict", "hf-assisted", "hf-prompt-lookup")


def token_class(piece: str) -> str:
    """The kind of text a token is, as the page shows it: whitespace, number, punctuation, identifier
    (code names: with ``_``, inner capitals or digits, or a Python keyword) or word; a coarser view of
    :func:`marspec.token_classes.token_class`."""
    return AUDIT_KIND[fine_class(piece)]


@dataclass
class MethodTally:
    """What one lossy method changed across the audited records."""

    name: str
    tokens: int = 0
    relaxations: int = 0
    changed: int = 0  # answers whose text differs from the reference's
    broken: int = 0  # the reference's score is higher
    fixed: int = 0  # the method's score is higher
    answers: int = 0
    classes: Counter = field(default_factory=Counter)

    @property
    def per_thousand(self) -> float:
        return 1000 * self.relaxations / self.tokens if self.tokens else 0.0


class Pieces:
    """Token ids to the text each one adds, decoded incrementally (a character split across tokens
    belongs to the token that completes it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def split(self, token_ids: Sequence[int]) -> list[str]:
        from marspec.detok import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer)
        return [detok.push([t]) for t in token_ids]

    def one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=True)


def write_audit(run_dir: Path, tokenizer: Any | None = None) -> Path:
    """Write ``RUN_DIR/audit.html`` for a finished or partial benchmark run; return its path.

    ``tokenizer`` decodes token ids; by default the run's target's (loaded from the model cache)."""
    config, summary = read_run(run_dir)
    if tokenizer is None:
        tokenizer = _target_tokenizer(config["target"])
    page = render_audit(config, summary, load_records(run_dir), Pieces(tokenizer))
    path = run_dir / AUDIT_FILE
    path.write_text(page, encoding="utf-8")
    return path


def render_audit(
    config: dict[str, Any], summary: dict[str, Any], records: dict[tuple, dict], pieces: Pieces
) -> str:
    """The page's HTML. Sample 0 of each question is audited (under sampling, later samples repeat the
    comparison with other seeds)."""
    reference = summary.get("quality_reference") or "strict"
    methods = [m for m in summary["methods"] if m not in NOT_AUDITED and m != reference]
    qids = summary.get("qids") or list(dict.fromkeys(q for q, _, _ in records))
    tallies = {m: MethodTally(m) for m in methods}
    sections = []
    for qid in qids:
        ref = records.get((qid, reference, 0))
        if ref is None:
            continue
        rows = []
        changed_here = False
        for method in methods:
            rec = records.get((qid, method, 0))
            if rec is None:
                continue
            row, changed = _compare(rec, ref, pieces, tallies[method])
            changed_here |= changed
            rows.append(row)
        if rows:
            sections.append(_question_section(qid, ref, reference, rows, open_=changed_here))
    return _page(config, summary, reference, list(tallies.values()), sections)


def _compare(rec: dict, ref: dict, pieces: Pieces, tally: MethodTally) -> tuple[str, bool]:
    """One method's output beside the reference's, with its tally updated."""
    tally.answers += 1
    ref_texts = [t["text"] for t in ref["turns"]]
    texts = [t["text"] for t in rec["turns"]]
    changed = texts != ref_texts
    tally.changed += changed
    score, ref_score = rec.get("score"), ref.get("score")
    if score is not None and ref_score is not None:
        tally.broken += score < ref_score
        tally.fixed += score > ref_score
    columns = []
    for turn, ref_turn in zip(rec["turns"], ref["turns"], strict=False):
        tally.tokens += turn.get("new_tokens") or 0
        relaxed = turn.get("relaxed")
        if relaxed is None or turn.get("token_ids") is None:
            columns.append(f'<pre class="out">{html.escape(turn["text"])}</pre>')
            continue
        tally.relaxations += len(relaxed)
        columns.append(_highlighted(turn, ref_turn, pieces, tally))
    verdict = _verdict(score)
    label = f"{html.escape(rec['method'])} {verdict}"
    return f'<div class="col"><h4>{label}</h4>{"".join(columns)}</div>', changed


def _highlighted(turn: dict, ref_turn: dict, pieces: Pieces, tally: MethodTally) -> str:
    ids: list[int] = turn["token_ids"]
    ref_ids: list[int] = ref_turn.get("token_ids") or []
    texts = pieces.split(ids)
    relaxed = {int(pos): (int(top1), float(margin)) for pos, _, top1, margin in turn["relaxed"]}
    diverge = next((i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b), None)
    if diverge is None and ref_ids and len(ids) != len(ref_ids):
        diverge = min(len(ids), len(ref_ids))
    out = []
    for i, piece in enumerate(texts):
        if i == diverge:
            out.append('<span class="diverge" title="first token that differs from the reference"></span>')
        shown = html.escape(piece)
        if i in relaxed:
            top1, margin = relaxed[i]
            tally.classes[token_class(piece)] += 1
            title = html.escape(
                f"relaxed: took {piece!r} where the target's top choice was {pieces.one(top1)!r}; "
                f"margin {margin:.3f}",
                quote=True,
            )
            if not piece.strip():  # make a relaxed space or newline visible: · for a space, ↵ for a newline
                shown = html.escape(piece.replace(" ", "\u00b7").replace("\n", "\u21b5\n"))
            shown = f'<mark class="relaxed" title="{title}">{shown or "&#8203;"}</mark>'
        out.append(shown)
    return f'<pre class="out">{"".join(out)}</pre>'


def _question_section(qid: str, ref: dict, reference: str, rows: list[str], open_: bool) -> str:
    ref_cols = "".join(f'<pre class="out">{html.escape(t["text"])}</pre>' for t in ref["turns"])
    head = f"{html.escape(qid)} · {html.escape(reference)} {_verdict(ref.get('score'))}"
    return (
        f'<details class="question"{" open" if open_ else ""}><summary>{head}</summary>'
        f'<div class="grid"><div class="col"><h4>{html.escape(reference)} {_verdict(ref.get("score"))}'
        f"</h4>{ref_cols}</div>{''.join(rows)}</div></details>"
    )


def _verdict(score: float | None) -> str:
    if score is None:
        return '<span class="na">unscored</span>'
    if score >= 1:
        return '<span class="pass">pass</span>'
    if score <= 0:
        return '<span class="fail">fail</span>'
    return f'<span class="part">{score:.2f}</span>'


def _summary_table(tallies: list[MethodTally], reference: str) -> str:
    head = (
        "<tr><th>method</th><th>tokens</th><th>relaxed</th><th>per 1,000 tokens</th>"
        f"<th>answers changed (vs {html.escape(reference)})</th><th>broken</th><th>fixed</th>"
        "<th>relaxed tokens by kind</th></tr>"
    )
    rows = []
    for t in tallies:
        total = sum(t.classes.values())
        kinds = ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in t.classes.most_common()) or "—"
        rows.append(
            f"<tr><td>{html.escape(t.name)}</td><td>{t.tokens}</td><td>{t.relaxations}</td>"
            f"<td>{t.per_thousand:.1f}</td><td>{t.changed} of {t.answers}</td><td>{t.broken}</td>"
            f"<td>{t.fixed}</td><td>{kinds}</td></tr>"
        )
    return f'<table class="summary">{head}{"".join(rows)}</table>'


def _page(
    config: dict[str, Any],
    summary: dict[str, Any],
    reference: str,
    tallies: list[MethodTally],
    sections: list[str],
) -> str:
    temp = config.get("temperature") or 0
    regime = "greedy" if not temp else f"temperature {temp:g}, sample 0 of each question"
    title = f"marspec audit · {config['task']} · {config['target']} with {config['draft']}"
    expected = sum(t.relaxations for t in tallies)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
table.summary {{ border-collapse: collapse; margin: 1em 0; }}
table.summary td, table.summary th {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
table.summary td:first-child, table.summary td:last-child {{ text-align: left; }}
details.question {{ border-top: 1px solid #ddd; padding: 0.4em 0; }}
summary {{ cursor: pointer; font-weight: 600; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(28em, 1fr)); gap: 1em; }}
pre.out {{ white-space: pre-wrap; font: 12px/1.45 ui-monospace, monospace; background: #f7f7f7;
  padding: 0.6em; margin: 0.3em 0; }}
mark.relaxed, mark.legend {{ background: #ffd54f; border-bottom: 2px solid #e65100; }}
span.diverge {{ border-left: 3px solid #d32f2f; margin: 0 1px; }}
.pass {{ color: #2e7d32; }} .fail {{ color: #c62828; }} .part, .na {{ color: #666; }}
h4 {{ margin: 0.4em 0 0; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(regime)}. Reference: <b>{html.escape(reference)}</b>.
A <mark class="legend">highlighted</mark> token was accepted by relaxation (hover for the
target's own top choice and the margin); a red bar marks the first token that differs from the
reference. Questions where an answer changed are open. (Relaxed accepts at or after an output's
end-of-sequence token are not in the output: summary.md's "relaxed" counts include them, this page
does not.)
Highlights found on this page:
<span id="found">(needs script)</span> of {expected} recorded.</p>
{_summary_table(tallies, reference)}
{"".join(sections)}
<script>
document.getElementById("found").textContent =
  String(document.querySelectorAll("mark.relaxed").length);
</script>
</body></html>
"""


def _target_tokenizer(target: str) -> Any:
    from transformers import AutoTokenizer

    from marspec.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(target), local_files_only=True)
