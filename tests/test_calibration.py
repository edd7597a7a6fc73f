"""theta="auto": choosing a setting from measurements, storing it per pair, and using it everywhere."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from marspec import Decoder, MarspecError
from marspec.calibration import Candidate, Choice, calibration_path, choose, load_choice, save_choice
from marspec.cli import app
from marspec.precision import choose_precision

SMALL = "smollm2-135m-instruct"
# The precision the CLI loads SMALL in when none is named (the int8 engine on a CPU that has it): a
# calibration is stored for the target's precision.
SMALL_QUANT = choose_precision(SMALL, "auto", "auto", torch.device("cpu")).target_quant
runner = CliRunner()


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSPEC_CALIBRATION_DIR", str(tmp_path / "calibrations"))
    return tmp_path / "calibrations"


def row(margin: str, theta: float, task: str, speedup: float, lo: float) -> Candidate:
    return Candidate(f"m@{theta}", margin, theta, task, speedup, speedup, 1.0, lo, 1.0, 30)


def test_choose_takes_the_fastest_setting_within_budget_on_every_task():
    rows = [
        row("logit_ratio", 0.9, "humaneval", 1.30, 0.90),  # fastest, but loses answers
        row("logit_ratio", 0.9, "gsm8k", 1.30, 1.00),
        row("prob_ratio", 0.5, "humaneval", 1.10, 1.00),
        row("prob_ratio", 0.5, "gsm8k", 1.08, 0.995),
        row("prob_ratio", 0.8, "humaneval", 1.05, 1.00),
        row("prob_ratio", 0.8, "gsm8k", 1.04, 1.00),
        row("logit_gap", 1.0, "humaneval", 1.50, 1.00),  # measured on one task only: not eligible
    ]
    margin, theta, met, reason = choose(rows, 0.99)
    assert (margin, theta, met) == ("prob_ratio", 0.5, True)
    assert "3 settings" not in reason and "2 settings" in reason
    assert choose(rows, 0.999)[:3] == ("prob_ratio", 0.8, True)


def test_choose_falls_back_to_strict_when_nothing_meets_the_budget():
    margin, theta, met, reason = choose([row("logit_ratio", 0.9, "gsm8k", 1.3, 0.8)], 0.99)
    assert (margin, theta, met) == ("logit_ratio", 1.0, False) and "strict" in reason


@pytest.mark.parametrize("budget", [0, 1.5, 2, float("nan"), -0.1])
def test_bad_budgets_are_refused(budget):
    with pytest.raises(MarspecError, match="--budget"):
        choose([], budget)


def choice(theta: float = 0.5, margin: str = "prob_ratio", temperature: float = 0.0) -> Choice:
    return Choice(margin, theta, 0.99, True, "test", temperature, {"gsm8k": ["gsm8k/0"]})


def test_greedy_and_sampling_are_stored_apart_for_one_pair(calibration_dir):
    path = save_choice("t", "d", choice(0.5))
    assert path.parent == calibration_dir
    save_choice("t", "d", choice(0.7, temperature=1.0))
    assert load_choice("t", "d", 0.0).theta == 0.5 and load_choice("t", "d", 0.0).margin == "prob_ratio"
    assert load_choice("t", "d", 0.7).theta == 0.7
    stored = json.loads(path.read_text())
    assert stored["greedy"]["tasks"] == {"gsm8k": ["gsm8k/0"]} and stored["target"] == "t"


def test_missing_corrupt_and_foreign_calibrations_are_clear_errors(calibration_dir):
    with pytest.raises(MarspecError, match="marspec calibrate --target t --draft d"):
        load_choice("t", "d", 0.0)
    save_choice("t", "d", choice())
    with pytest.raises(MarspecError, match=r"sampling calibration.*--temperature 1\.0"):
        load_choice("t", "d", 1.0)
    path = calibration_path("t", "d")
    path.write_text("{not json")
    with pytest.raises(MarspecError, match="corrupt"):
        load_choice("t", "d", 0.0)
    with pytest.raises(MarspecError, match="corrupt"):
        save_choice("t", "d", choice())
    assert path.read_text() == "{not json"  # nothing overwritten
    other = calibration_path("x", "y")
    other.write_text(
        path.read_text().replace("{not json", json.dumps({"version": 1, "target": "a", "draft": "b"}))
    )
    with pytest.raises(MarspecError, match="is for target 'a'"):
        load_choice("x", "y", 0.0)


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return Decoder(SMALL, "ngram", dtype="fp32")


def test_decoder_theta_auto_uses_the_stored_setting(decoder):
    prompt = "Repeat this list: apple, banana, cherry, apple, banana, cherry."
    with pytest.raises(MarspecError, match="theta='auto' needs a greedy calibration"):
        decoder.generate(prompt, rule="mars", theta="auto", max_new_tokens=8)
    # strict and plain never relax, so they need no calibration
    assert decoder.generate(prompt, rule="strict", theta="auto", max_new_tokens=8).token_ids
    save_choice(SMALL, "ngram", choice(0.05, "prob_ratio"))
    auto = decoder.generate(prompt, rule="mars", theta="auto", max_new_tokens=24)
    explicit = decoder.generate(prompt, rule="mars", theta=0.05, margin="prob_ratio", max_new_tokens=24)
    assert (
        auto.token_ids == explicit.token_ids
        and auto.stats.accepted_relaxed == explicit.stats.accepted_relaxed
    )
    opts = decoder.resolve_theta(replace(_options(), theta="auto"))
    assert (opts.theta, opts.margin) == (0.05, "prob_ratio")


def test_a_quantised_targets_calibration_is_its_own():
    save_choice(SMALL, "ngram", choice(0.05, "prob_ratio"), "int8")
    assert calibration_path(SMALL, "ngram", "int8") != calibration_path(SMALL, "ngram")
    assert load_choice(SMALL, "ngram", 0.0, "int8").theta == 0.05
    with pytest.raises(MarspecError, match="--target-quant none"):
        load_choice(SMALL, "ngram", 0.0)  # the float model's: none stored
    with pytest.raises(MarspecError, match=r"'smollm2-135m-instruct \(int4\)'.*--target-quant int4"):
        load_choice(SMALL, "ngram", 0.0, "int4")


def _options():
    from marspec.api import GenerationOptions

    return GenerationOptions(rule="mars")


def test_cli_calibrate_end_to_end_then_theta_auto(calibration_dir, tmp_path):
    args = ["calibrate", "--target", SMALL, "--draft", "ngram", "--task", "gsm8k", "--limit", "2"]
    args += ["--max-new-tokens", "16", "--candidates", "mars-prob@0.05,mars-ratio@0.99", "--threads", "1"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert "chose" in result.output and "theta=auto" in result.output
    stored = json.loads(calibration_path(SMALL, "ngram", SMALL_QUANT).read_text())["greedy"]
    assert {r["method"] for r in stored["table"]} == {"mars-prob@0.05", "mars-ratio@0.99"}
    assert stored["tasks"]["gsm8k"] == ["gsm8k/0", "gsm8k/1"]
    assert (stored["margin"], stored["theta"]) in {
        ("prob_ratio", 0.05),
        ("logit_ratio", 0.99),
        ("logit_ratio", 1.0),
    }
    gen = runner.invoke(
        app,
        [
            "generate",
            "Count to three.",
            "--target",
            SMALL,
            "--draft",
            "ngram",
            "--rule",
            "mars",
            "--theta",
            "auto",
            "--json",
        ],
    )
    assert gen.exit_code == 0, gen.output
    assert json.loads(gen.output.splitlines()[-1])["stats"]["new_tokens"] > 0

    # The same run, read back by `marspec choose`, supports the same choice without measuring again.
    run = tmp_path / "runs" / "gsm8k-t0"
    calibration_path(SMALL, "ngram", SMALL_QUANT).unlink()
    chosen = runner.invoke(app, ["choose", str(run), "--budget", "0.99"])
    assert chosen.exit_code == 0, chosen.output
    again = json.loads(calibration_path(SMALL, "ngram", SMALL_QUANT).read_text())["greedy"]
    assert (again["margin"], again["theta"], again["tasks"]) == (
        stored["margin"],
        stored["theta"],
        stored["tasks"],
    )
    assert again["table"] == stored["table"]
    for bad, needle in (([run, run], "two runs"), ([tmp_path / "nowhere"], "not a finished")):
        refused = runner.invoke(app, ["choose", *map(str, bad)])
        assert refused.exit_code == 2 and needle in refused.output, refused.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["calibrate", "--budget", "2"], "--budget"),
        (["calibrate", "--samples", "0", "--temperature", "1"], "--samples"),
        (["calibrate", "--task", "mtbench"], "graded task"),
        (["calibrate", "--candidates", "plain"], "no MARS setting"),
        (["calibrate", "--candidates", "mars-prob@0.5+next"], "do not describe +next"),
        (["choose", ".", "--budget", "0"], "--budget"),
        (
            ["generate", "hi", "--target", SMALL, "--draft", "ngram", "--rule", "mars", "--theta", "auto"],
            "marspec calibrate",
        ),
        (["generate", "hi", "--theta", "high"], "--theta must be a number"),
        (["bench", "--theta", "auto", "--target", SMALL, "--draft", "ngram"], "marspec calibrate"),
    ],
)
def test_cli_bad_calibration_input_is_one_line_and_exit_2(args, needle, tmp_path):
    result = runner.invoke(
        app, [*args, "--out", str(tmp_path)] if args[0] in ("calibrate", "bench") else args
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.output


def test_cli_refuses_a_corrupt_calibration_before_measuring(calibration_dir, tmp_path):
    path = calibration_path(SMALL, "ngram", SMALL_QUANT)
    path.parent.mkdir(parents=True)
    path.write_text("[]")
    result = runner.invoke(
        app, ["calibrate", "--target", SMALL, "--draft", "ngram", "--task", "gsm8k", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2 and "corrupt" in result.output
    assert path.read_text() == "[]" and not any(tmp_path.glob("gsm8k-*"))


def test_calibration_is_callable_from_the_library(calibration_dir, tmp_path):
    from marspec.eval.calibrate import calibrate
    from marspec.eval.harness import new_decoder

    loads, finished = [], []

    def load(target, draft, dtype, threads, settings):
        loads.append((target, draft, dtype, threads))
        return new_decoder(target, draft, dtype, threads, settings)

    choice, path = calibrate(
        target=SMALL,
        draft="ngram",
        tasks=["gsm8k"],
        limit=1,
        candidates=["mars-prob@0.05"],
        max_new_tokens=8,
        threads=1,
        out=tmp_path,
        load=load,
        on_task=lambda task, folder, summary: finished.append((task, folder, summary["questions"])),
    )
    assert loads == [(SMALL, "ngram", "fp32", 1)]
    assert finished == [("gsm8k", tmp_path / "gsm8k-t0", 1)]
    assert path == calibration_path(SMALL, "ngram", SMALL_QUANT)
    rule = load_choice(SMALL, "ngram", 0.0, SMALL_QUANT)  # theta="auto" now finds it
    assert (rule.margin, rule.theta) == (choice.margin, choice.theta)
    stored = json.loads(path.read_text())["greedy"]
    assert (stored["margin"], stored["theta"]) == (choice.margin, choice.theta)
    assert stored["tasks"] == {"gsm8k": ["gsm8k/0"]}
    with pytest.raises(MarspecError, match="graded task"):
        calibrate(tasks=["mtbench"], out=tmp_path, load=load)
    assert len(loads) == 1  # refused before loading anything
