"""The audit page (marspec report --html): built from a real benchmark run, checked in a real browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SMALL, bench_config
from typer.testing import CliRunner

from marspec import Decoder
from marspec.cli import app
from marspec.eval.audit import token_class, write_audit
from marspec.eval.datasets import load_task
from marspec.eval.grading import grader_for
from marspec.eval.methods import parse_methods
from marspec.eval.rundir import load_records
from marspec.eval.runner import run_bench

SPEC = "strict,topk@50"  # prompt-lookup drafts the target ranks 2nd-50th are relaxed: many highlights


@pytest.mark.parametrize(
    ("piece", "kind"),
    [
        ("   ", "whitespace"),
        ("\n", "whitespace"),
        (" 42", "number"),
        ("3.5", "number"),
        ("):", "punctuation"),
        (" my_list", "identifier"),
        ("camelCase", "identifier"),
        (" return", "identifier"),  # a Python keyword
        ("x2", "identifier"),
        (" apples", "word"),
    ],
)
def test_token_classes(piece: str, kind: str) -> None:
    assert token_class(piece) == kind


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    decoder = Decoder(SMALL, "ngram", dtype="fp32")
    config = bench_config(
        SPEC,
        theta=0.5,
        margin="prob_ratio",
        k=4,
        max_new_tokens=48,
        draft="ngram",
        draft_quant="none",
        draft_confidence=0.0,
        lookup=False,
    )
    out = tmp_path_factory.mktemp("audit-run")
    run_bench(decoder, load_task("gsm8k", 3), parse_methods(SPEC, 0.5), config, out, grader_for("gsm8k"))
    return out


def recorded_relaxations(run_dir: Path) -> int:
    records = load_records(run_dir)
    return sum(len(t["relaxed"]) for (_, m, _), r in records.items() if m == "topk@50" for t in r["turns"])


def test_the_page_highlights_every_recorded_relaxation(run_dir: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(run_dir), "--html", "--resummarize"])
    assert result.exit_code == 0, result.output
    assert "rewrote" in result.output  # the summary, from the records (tests/test_bench.py checks it)
    page = (run_dir / "audit.html").read_text()
    expected = recorded_relaxations(run_dir)
    assert expected > 0
    assert page.count('<mark class="relaxed"') == expected
    assert "the target&#x27;s top choice was" in page  # each highlight names what it replaced
    row = re.search(r"<tr><td>topk@50</td><td>(\d+)</td><td>(\d+)</td>", page)
    assert row is not None and int(row.group(2)) == expected
    assert page.count('class="question"') == 3


def test_the_page_opens_in_chromium_and_shows_its_highlights(run_dir: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("MARSPEC_REQUIRE_BROWSER"):
            pytest.fail("MARSPEC_REQUIRE_BROWSER is set but chromium is not installed (apt install chromium)")
        pytest.skip("chromium is not installed (make test installs it: apt install chromium)")
    page = write_audit(run_dir)
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    # The page's script counted the highlights the browser rendered.
    found = re.search(r'<span id="found">(\d+)</span>', dom)
    assert found is not None, dom[:2000]
    assert int(found.group(1)) == recorded_relaxations(run_dir) > 0
