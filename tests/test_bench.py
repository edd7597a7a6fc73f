"""The benchmark runner end to end on a small real model: records, resumption, refusal to mix configs,
peers, summary and plots."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from conftest import SMALL, bench_config

from marspec import Decoder, MarspecError
from marspec.eval import quality_table, rules_table, time_budget
from marspec.eval.bench import BenchConfig
from marspec.eval.calibrate import choice_from_runs
from marspec.eval.cpu import cpu_from_cpuinfo, cpu_name
from marspec.eval.datasets import load_task
from marspec.eval.grading import grader_for
from marspec.eval.intervals import exchange_p_value
from marspec.eval.methods import parse_methods
from marspec.eval.report import combined_pareto, make_report
from marspec.eval.rundir import RECORDS_FILE, SUMMARY_JSON, SUMMARY_MD, load_records, prepare_out_dir
from marspec.eval.runner import profile_once, run_bench
from marspec.eval.summary import resummarize


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    # The small model drafts for itself: a real same-tokenizer pair, fast enough for a test.
    return Decoder(SMALL, SMALL, dtype="fp32")


def config(methods: str) -> BenchConfig:
    return bench_config(methods)


def test_tiny_bench_end_to_end_and_resume(decoder, tmp_path):
    spec = "plain,strict,mars,mars@0.5,hf-assisted,hf-prompt-lookup"
    methods = parse_methods(spec, 0.9)
    questions = load_task("gsm8k", 2)
    calls = []
    profile_once(decoder, config(spec), tmp_path)
    summary = run_bench(
        decoder,
        questions,
        methods,
        config(spec),
        tmp_path,
        grader_for("gsm8k"),
        on_done=lambda q, m, sample, skipped: calls.append(skipped),
    )
    assert calls == [False] * 12
    assert summary["questions"] == 2
    plain, strict = summary["methods"]["plain"], summary["methods"]["strict"]
    assert plain["speedup"] == pytest.approx(1.0)
    assert strict["same_as_baseline"] == 2  # strict reproduces plain (fp32)
    assert summary["methods"]["hf-assisted"]["tau"] is not None
    assert summary["methods"]["hf-assisted"]["achieved_vs_ideal"] is None  # its loop records no steps
    for name in ("plain", "strict", "mars"):
        # Its value depends on how busy the machine is (the profile and the run are timed apart): a
        # benchmark's finding, so only its presence and sign are checked here.
        ratio = summary["methods"][name]["achieved_vs_ideal"]
        assert math.isfinite(ratio) and ratio > 0
    # Plain's one-token step as the run measured it, beside the profile's snapshot of it.
    plain_steps = [
        1000 * (t["target_forward_s"] - t["prefill_s"]) / (t["target_forwards"] - 1)
        for (_, method, _), rec in load_records(tmp_path).items()
        if method == "plain"
        for t in rec["turns"]
    ]
    step = summary["one_token_step"]
    assert step["min_ms"] == pytest.approx(min(plain_steps))
    assert step["max_ms"] == pytest.approx(max(plain_steps))
    # timing-guard: order statistics of one sample, whatever the machine's speed
    assert step["min_ms"] <= step["median_ms"] <= step["max_ms"] and step["profiled_ms"] > 0
    assert "one-token target step" in (tmp_path / "summary.md").read_text()
    for name in ("plain", "strict", "mars"):
        assert summary["methods"][name]["score"] is not None
    # Where the wall time went: target forwards, draft forwards and the loop itself add up to it.
    for name in ("strict", "mars"):
        m = summary["methods"][name]
        assert 0 < m["draft_share"] < 1 and 0 < m["target_share"] < 1
        assert m["target_share"] + m["draft_share"] + m["overhead_share"] == pytest.approx(1.0)
    assert plain["draft_share"] == 0 and summary["methods"]["hf-prompt-lookup"]["draft_share"] == 0
    assert 0 < summary["methods"]["hf-assisted"]["draft_share"] < 1  # the assistant's forwards, timed
    assert (tmp_path / "summary.md").read_text().count("|") > 20
    assert "draft share" in (tmp_path / "summary.md").read_text()
    # Each record carries what an audit needs: the output's tokens and every relaxed one.
    for rec in load_records(tmp_path).values():
        for turn in rec["turns"]:
            assert len(turn["token_ids"]) == turn["new_tokens"]
            # Relaxed accepts at or after the end-of-sequence token are cut with it from the output.
            assert len(turn["relaxed"]) <= (turn["accepted_relaxed"] or 0)

    # marspec.eval.time_budget prices the same run: its drafting is the measured draft time.
    budget = time_budget
    seconds = budget.budget(tmp_path)
    assert set(seconds) == {"plain", "strict", "mars", "mars@0.5"}  # the peers record no steps
    assert seconds["strict"]["draft"] == pytest.approx(strict["draft_share"] * strict["wall_s"])
    assert seconds["strict"]["verify"] > 0 and seconds["plain"]["draft"] == 0
    table = budget.report(tmp_path)
    assert table.count("\n| ") == 5  # header and four methods
    strict_row = next(line for line in table.splitlines() if line.startswith("| strict |"))
    per_draft = 1000 * seconds["strict"]["draft"] / seconds["strict"]["draft_forwards"]
    assert f"| {per_draft:.1f} |" in strict_row  # a draft forward's cost, in milliseconds

    # A second run over the same directory resumes: nothing is generated again.
    calls.clear()
    again = run_bench(
        decoder,
        questions,
        methods,
        config(spec),
        tmp_path,
        grader_for("gsm8k"),
        on_done=lambda q, m, sample, skipped: calls.append(skipped),
    )
    assert calls == [True] * 12
    assert again["methods"]["strict"]["tau"] == strict["tau"]

    paths = make_report(tmp_path)
    assert {p.name for p in paths} >= {
        "acceptance_by_position.png",
        "margin_distribution.png",
        "theta_sweep.png",
    }
    assert all(p.stat().st_size > 1000 for p in paths)

    # Where plain ran on some questions only (--plain-limit), time_budget.py prices every method over
    # those questions, so its ratios compare the same questions.
    first, second = (q.qid for q in questions)
    path = tmp_path / RECORDS_FILE
    kept = [
        line
        for line in path.read_text().splitlines()
        if (json.loads(line)["qid"], json.loads(line)["method"]) != (second, "plain")
    ]
    path.write_text("\n".join(kept) + "\n")
    records = load_records(tmp_path)
    strict_first = records[first, "strict", 0]["turns"]
    assert budget.budget(tmp_path)["strict"]["tokens"] == sum(turn["new_tokens"] for turn in strict_first)


def test_interrupted_run_resumes_from_the_last_whole_record(decoder, tmp_path):
    spec = "plain,strict"
    methods = parse_methods(spec, 0.9)
    questions = load_task("gsm8k", 2)
    run_bench(decoder, questions[:1], methods, config(spec), tmp_path, grader_for("gsm8k"))
    with (tmp_path / RECORDS_FILE).open("a") as f:
        f.write('{"qid": "torn')  # what a kill mid-write leaves
    done = []
    run_bench(
        decoder,
        questions,
        methods,
        config(spec),
        tmp_path,
        grader_for("gsm8k"),
        on_done=lambda q, m, sample, skipped: done.append((q.qid, m.name, skipped)),
    )
    assert [d[2] for d in done] == [True, True, False, False]
    assert len(load_records(tmp_path)) == 4

    # `marspec report --resummarize` rewrites a whole run's summary from its records alone.
    written = json.loads((tmp_path / SUMMARY_JSON).read_text())
    (tmp_path / SUMMARY_JSON).write_text(json.dumps({**written, "methods": {"plain": {}, "strict": {}}}))
    (tmp_path / SUMMARY_MD).unlink()
    assert json.loads(json.dumps(resummarize(tmp_path))) == written  # tuples come back as lists
    assert json.loads((tmp_path / SUMMARY_JSON).read_text()) == written
    assert "strict" in (tmp_path / SUMMARY_MD).read_text()

    # marspec.eval.quality_table tabulates a whole run and refuses one that lost a record.
    table = quality_table
    assert [row.split(" | ")[2] for row in table.rows(tmp_path)] == ["plain", "strict"]
    lines = (tmp_path / RECORDS_FILE).read_text().splitlines()
    (tmp_path / RECORDS_FILE).write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(MarspecError, match="not a whole run"):
        table.rows(tmp_path)
    summary_before = (tmp_path / SUMMARY_JSON).read_text()
    with pytest.raises(MarspecError, match="not a whole run"):
        resummarize(tmp_path)
    assert (tmp_path / SUMMARY_JSON).read_text() == summary_before  # nothing overwritten
    (tmp_path / RECORDS_FILE).unlink()
    with pytest.raises(MarspecError, match=r"no records\.jsonl"):
        resummarize(tmp_path)


BUSY = float(os.cpu_count() or 1) + 1.0


def test_records_timed_on_a_busy_machine_are_flagged_and_can_be_redone(decoder, tmp_path):
    spec = "plain,strict"
    methods = parse_methods(spec, 0.9)
    questions = load_task("gsm8k", 2)
    run_bench(decoder, questions, methods, config(spec), tmp_path, grader_for("gsm8k"))
    records = load_records(tmp_path)
    assert all("other_cores" in r and r["started"].endswith("+00:00") for r in records.values())
    # Mark one record as made while other processes kept cores busy, the others as made on a quiet machine
    # (this test may itself run beside other work). BUSY is more cores than the machine has, a load no
    # measurement gives, so the record decoded again is told apart by its own.
    path = tmp_path / RECORDS_FILE
    marked = [json.loads(line) for line in path.read_text().splitlines()]
    for i, rec in enumerate(marked):
        rec["other_cores"] = BUSY if i == 1 else 0.0
    path.write_text("".join(json.dumps(rec) + "\n" for rec in marked))
    busy = marked[1]
    summary = run_bench(decoder, questions, methods, config(spec), tmp_path, grader_for("gsm8k"))
    assert summary["methods"][busy["method"]]["contended"] == 1
    assert "Timings suspect" in (tmp_path / "summary.md").read_text()

    redone = []
    run_bench(
        decoder,
        questions,
        methods,
        config(spec),
        tmp_path,
        grader_for("gsm8k"),
        lambda q, m, sample, skipped: redone.append((q.qid, m.name)) if not skipped else None,
        redo_contended=True,
    )
    assert redone == [(busy["qid"], busy["method"])]
    assert len(path.read_text().splitlines()) == len(marked) + 1  # appended; the newest line wins
    latest = load_records(tmp_path)[busy["qid"], busy["method"], 0]
    assert latest["other_cores"] != BUSY and latest["turns"][0]["text"] == busy["turns"][0]["text"]


def test_records_from_another_cpu_are_flagged_and_can_be_redone(decoder, tmp_path):
    spec = "plain,strict"
    methods = parse_methods(spec, 0.9)
    questions = load_task("gsm8k", 2)
    run_bench(decoder, questions, methods, config(spec), tmp_path, grader_for("gsm8k"))
    path = tmp_path / RECORDS_FILE
    lines = path.read_text().splitlines()
    elsewhere = json.loads(lines[2])
    elsewhere["cpu"] = "Another CPU"  # as if the run had been resumed on another machine
    lines[2] = json.dumps(elsewhere)
    path.write_text("\n".join(lines) + "\n")

    def run(**redo) -> tuple[dict, list]:
        redone = []
        summary = run_bench(
            decoder,
            questions,
            methods,
            config(spec),
            tmp_path,
            grader_for("gsm8k"),
            lambda q, m, sample, skipped: redone.append((q.qid, m.name)) if not skipped else None,
            **redo,
        )
        return summary, redone

    summary, redone = run()
    assert redone == [] and summary["cpus"] == {cpu_name(): 3, "Another CPU": 1}
    assert "Decoded on 2 processor models" in (tmp_path / "summary.md").read_text()
    # Strict's decode of that question has no baseline (plain) from its CPU: left out of its speed.
    strict = summary["methods"]["strict"]
    assert (strict["speed_questions"], strict["speed_unpaired"]) == (1, 1)
    summary, redone = run(redo_other_cpu=True)
    assert redone == [(elsewhere["qid"], elsewhere["method"])]
    assert summary["cpus"] == {cpu_name(): 4}
    assert (
        summary["methods"]["strict"]["speed_questions"],
        summary["methods"]["strict"]["speed_unpaired"],
    ) == (2, 0)
    assert "processor models" not in (tmp_path / "summary.md").read_text()
    # The first question's strict as if decoded again in a sitting three hours later: its speed ratio is
    # flagged, and --redo-apart decodes that question's methods again together, once.
    lines = path.read_text().splitlines()
    qid0 = json.dumps(questions[0].qid)
    first_strict = max(i for i, line in enumerate(lines) if '"method": "strict"' in line and qid0 in line)
    later = json.loads(lines[first_strict])
    later["started"] = (datetime.fromisoformat(later["started"]) + timedelta(hours=3)).isoformat()
    lines[first_strict] = json.dumps(later)
    path.write_text("\n".join(lines) + "\n")
    summary, redone = run()
    assert summary["methods"]["strict"]["speed_apart"] == 1
    assert "Speed timed in different sittings" in (tmp_path / "summary.md").read_text()
    summary, redone = run(redo_apart=True)
    assert redone == [(questions[0].qid, "plain"), (questions[0].qid, "strict")]
    assert summary["methods"]["strict"]["speed_apart"] == 0
    assert run(redo_apart=True)[1] == []  # resumable: what is back to back stays


def test_a_sample_whole_on_another_cpu_is_kept_and_one_decoded_here_moves_here(decoder, tmp_path):
    """--redo-other-cpu decodes again only what a speed ratio would pair across CPUs: a question's sample
    whose methods all ran on another CPU stays; one that gets a decode here (a method added) moves here."""
    spec = "plain,strict"
    questions = load_task("gsm8k", 2)
    run_bench(decoder, questions, parse_methods(spec, 0.9), config(spec), tmp_path, grader_for("gsm8k"))
    path = tmp_path / RECORDS_FILE
    moved = [{**json.loads(line), "cpu": "Another CPU"} for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(rec) + "\n" for rec in moved))

    def run(spec: str) -> tuple[dict, list]:
        redone = []
        summary = run_bench(
            decoder,
            questions,
            parse_methods(spec, 0.9),
            config(spec),
            tmp_path,
            grader_for("gsm8k"),
            lambda q, m, sample, skipped: redone.append((q.qid, m.name)) if not skipped else None,
            redo_other_cpu=True,
        )
        return summary, redone

    summary, redone = run(spec)
    assert redone == [] and summary["cpus"] == {"Another CPU": 4}
    assert summary["methods"]["strict"]["speed_questions"] == 2  # paired on the CPU they ran on
    # MARS joins the run on this CPU: each question's plain and strict are decoded again beside it.
    spec += ",mars"
    lines = path.read_text().splitlines()
    summary, redone = run(spec)
    assert redone == [(q.qid, m) for q in questions for m in ("plain", "strict", "mars")]
    assert summary["cpus"] == {cpu_name(): 6}
    assert len(path.read_text().splitlines()) == len(lines) + 6


def test_cpu_names_tell_generations_apart():
    zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
    zen5 += "model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert cpu_from_cpuinfo(zen5) == "AMD EPYC (family 26, model 2, stepping 1)"
    zen4 = zen5.replace("26", "25").replace("model\t\t: 2", "model\t\t: 17")
    assert cpu_from_cpuinfo(zen4) == "AMD EPYC (family 25, model 17, stepping 1)"
    assert cpu_from_cpuinfo("model name\t: Some CPU\n") == "Some CPU"  # no x86 generation fields
    assert cpu_from_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\n") is None  # ARM: the platform guesses
    assert cpu_name()


def test_runs_on_the_same_questions_share_one_pareto_plot(decoder, tmp_path):
    questions = load_task("gsm8k", 2)

    def length_score(question, texts):  # the small model solves no GSM8K question: recovery needs a score
        return {"score": min(1.0, len(texts[0]) / 100)}

    for name, spec in (("sweep", "strict,mars-prob@0.3"), ("rivals", "strict,typical@0.2,topk@2")):
        run_bench(decoder, questions, parse_methods(spec, 0.9), config(spec), tmp_path / name, length_score)
    plot = combined_pareto([tmp_path / "rivals", tmp_path / "sweep"], tmp_path / "both.png")
    assert plot.stat().st_size > 1000
    # marspec.eval.rules_table: the same runs as one table, a method shared by both taken from the first,
    # counting the decodes timed on a busy machine (here one, marked so whatever else this machine runs).
    for name in ("rivals", "sweep"):
        path = tmp_path / name / RECORDS_FILE
        marked = [json.loads(line) for line in path.read_text().splitlines()]
        for i, rec in enumerate(marked):
            rec["other_cores"] = 1.0 if (name, i) == ("rivals", 0) else 0.0
        path.write_text("".join(json.dumps(rec) + "\n" for rec in marked))
    lines, points, busy = rules_table.rows([tmp_path / "rivals", tmp_path / "sweep"])
    assert busy == 1
    assert [line.split(" (")[0].removeprefix("| ") for line in lines] == [
        "strict",
        "typical@0.2",
        "topk@2",
        "mars-prob@0.3",
    ]
    assert [p[0] for p in points] == ["typical@0.2", "topk@2", "mars-prob@0.3"]
    # --pooled: the rivals run twice over holds each question twice, so every count doubles.
    cells = {line.split(" (")[0].removeprefix("| "): line.split(" | ") for line in lines}
    twice = rules_table.pooled([tmp_path / "rivals", tmp_path / "rivals"])
    names = [row.split(" | ")[0].removeprefix("| ") for row in twice[2:]]
    assert names == ["strict", "typical@0.2", "topk@2"]
    for name, row in zip(names, twice[2:], strict=True):
        _, _, _, passed, lost_won, _ = row.split(" | ")
        passed_once, n_once = cells[name][4].split("/")
        assert float(passed.split("/")[0]) == pytest.approx(2 * float(passed_once), rel=1e-3)
        assert passed.split("/")[1] == str(2 * int(n_once))
        assert lost_won == " / ".join(str(2 * int(x)) for x in cells[name][5].split(" / "))

    spec = "strict,mars-prob@0.3"
    other_task = replace(config(spec), task="mtbench")
    run_bench(
        decoder,
        load_task("mtbench", 1),
        parse_methods(spec, 0.9),
        other_task,
        tmp_path / "mt",
        grader_for("mtbench"),
    )
    with pytest.raises(MarspecError, match="differ in task"):
        combined_pareto([tmp_path / "sweep", tmp_path / "mt"], tmp_path / "x.png")
    lines = (tmp_path / "sweep" / RECORDS_FILE).read_text().splitlines()
    (tmp_path / "sweep" / RECORDS_FILE).write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(MarspecError, match="not a whole run"):
        combined_pareto([tmp_path / "rivals", tmp_path / "sweep"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_second_turns_reuse_the_first_turns_cache_and_decode_the_same(decoder, tmp_path, monkeypatch):
    spec = "plain,strict,mars"
    methods = parse_methods(spec, 0.9)
    questions = load_task("mtbench", 1)
    # Count the tokens the target really scores (every chain forward), apart from what the records say.
    scored: list[int] = []
    target_forward = decoder.target.forward

    def counting_forward(tokens, *args, **kwargs):
        scored.append(int(tokens.shape[0]))
        return target_forward(tokens, *args, **kwargs)

    monkeypatch.setattr(decoder.target, "forward", counting_forward)
    runs, target_tokens = {}, {}
    for reuse in (False, True):
        scored.clear()
        cfg = replace(config(spec), task="mtbench", prefix_reuse=reuse)
        run_bench(decoder, questions, methods, cfg, tmp_path / str(reuse), grader_for("mtbench"))
        runs[reuse] = {r["method"]: r["turns"] for r in load_records(tmp_path / str(reuse)).values()}
        target_tokens[reuse] = sum(scored)
    for method in ("plain", "strict", "mars"):
        fresh, reused = runs[False][method], runs[True][method]
        assert [t["token_ids"] for t in reused] == [t["token_ids"] for t in fresh], method
        assert [t["reused_tokens"] for t in fresh] == [0, 0]
        # Turn 1 always starts empty, so no method inherits another method's cache; turn 2 keeps at least
        # turn 1's prompt, so its prefill scores only the rest of the same prompt.
        assert reused[0]["reused_tokens"] == 0
        assert reused[1]["prompt_tokens"] == fresh[1]["prompt_tokens"]
        assert reused[1]["reused_tokens"] >= reused[0]["prompt_tokens"] - 1
        # The same output from the same drafts: the same verification forwards, one prefill each.
        assert [t["target_forwards"] for t in reused] == [t["target_forwards"] for t in fresh], method
        assert [t["verify_sizes"] for t in reused] == [t["verify_sizes"] for t in fresh], method
    # What reuse spared is exactly the tokens the records call reused: the target scored that many fewer.
    spared = sum(t["reused_tokens"] for turns in runs[True].values() for t in turns)
    assert spared > 0
    assert target_tokens[False] - target_tokens[True] == spared


def test_tree_methods_run_in_the_bench_and_strict_tree_equals_plain(decoder, tmp_path):
    spec = "plain,strict+tree,mars@0.5+tree"
    cfg = replace(config(spec), tree="2,2")
    profile_once(decoder, cfg, tmp_path)
    summary = run_bench(
        decoder, load_task("gsm8k", 1), parse_methods(spec, 0.9), cfg, tmp_path, grader_for("gsm8k")
    )
    assert summary["methods"]["strict+tree"]["same_as_baseline"] == 1
    assert summary["methods"]["mars@0.5+tree"]["tau"] > 1.0
    # The profile covers a full tree's forward: chain of k = 3, the root and 2 siblings.
    assert max(int(n) for n in json.loads((tmp_path / "profile.json").read_text())["target"]) >= 6


def test_refuses_to_mix_configurations(tmp_path):
    prepare_out_dir(tmp_path, config("plain,strict"))
    with pytest.raises(MarspecError, match=r"different configuration.*k"):
        prepare_out_dir(tmp_path, replace(config("plain,strict"), k=4))
    with pytest.raises(MarspecError, match="theta"):
        prepare_out_dir(tmp_path, replace(config("plain,strict"), theta=0.5))  # bare "mars" would differ
    assert json.loads((tmp_path / "config.json").read_text())["k"] == 3


def test_methods_can_be_added_to_a_run_and_reuse_its_records(decoder, tmp_path):
    questions = load_task("gsm8k", 1)
    grade = grader_for("gsm8k")
    run_bench(decoder, questions, parse_methods("strict", 0.9), config("strict"), tmp_path, grade)
    done = []
    spec = "strict,mars-prob@0.5"
    summary = run_bench(
        decoder,
        questions,
        parse_methods(spec, 0.9),
        replace(config(spec), plain_limit=1),
        tmp_path,
        grade,
        on_done=lambda q, m, sample, skipped: done.append((m.name, skipped)),
    )
    assert done == [("strict", True), ("mars-prob@0.5", False)]
    assert all(r["cpu"] for r in load_records(tmp_path).values())  # where each record ran
    assert set(summary["methods"]) == {"strict", "mars-prob@0.5"}
    prepare_out_dir(tmp_path, config("plain"))
    stored = json.loads((tmp_path / "config.json").read_text())["methods"]
    assert stored == ["strict", "mars-prob@0.5", "plain"]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("plain,turbo", "unknown method"),
        ("mars@1.5", "theta"),
        ("mars@x", "number"),
        ("", "no methods"),
        ("plain,plain", "twice"),
        ("plain+tree", "only marspec's rules"),
        ("typical", "needs its parameter"),
        ("topk@2.5", "invalid for rule 'topk'"),
        ("pthresh@x", "must be a number"),
        ("topk@3+next", "only MARS methods"),
        ("mars+fast", r"suffixes are \+tree, \+next, \+class"),
        ("strict+next", "only MARS methods"),
        ("mars-prob", "needs its theta"),
        ("mars-prob@1.5", "theta"),
        ("mars-gap@-1", "theta"),
    ],
)
def test_bad_method_lists(spec, needle):
    with pytest.raises(MarspecError, match=needle):
        parse_methods(spec, 0.9)


def test_a_mars_method_is_validated_against_the_margin_it_runs_with():
    # Issue 36: an unset margin was validated as logit_ratio, while the library's default is prob_ratio.
    (mars,) = parse_methods("mars", 2.0, margin="logit_gap")  # the run's margin: a gap of 2 is valid
    assert (mars.kind, mars.theta, mars.margin) == ("mars", 2.0, None)
    with pytest.raises(MarspecError, match="invalid for margin 'prob_ratio'"):
        parse_methods("mars@2", 0.5)  # no margin anywhere: the library's default decides the range


def test_fly_and_guarded_methods_parse():
    fly, fly3, guarded, topk = parse_methods("fly@0.3,fly-w3@0.5,mars-prob@0.5+class,topk@3+class", 0.5)
    assert (fly.kind, fly.theta, fly.window, fly.needs_draft_model) == ("fly", 0.3, None, True)
    assert (fly3.kind, fly3.theta, fly3.window) == ("fly", 0.5, 3)
    assert (guarded.kind, guarded.margin, guarded.guard) == ("mars", "prob_ratio", "class")
    assert (topk.kind, topk.guard) == ("topk", "class")
    for spec, needle in [
        ("fly@0.3+tree", "not a token tree"),
        ("fly-wx@0.3", "fly-wN@THETA"),
        ("fly-w0@0.3", "window=0"),
        ("fly", "needs its parameter"),
        ("plain+class", r"\+class guard"),
        ("fly@0.3+next", "only MARS methods"),
    ]:
        with pytest.raises(MarspecError, match=needle):
            parse_methods(spec, 0.5)


def test_rival_methods_parse_with_their_parameter():
    typical, pthresh, topk = parse_methods("typical@0.09,pthresh@0.4,topk@3+tree", 0.9)
    assert (typical.kind, typical.theta, typical.needs_draft_model) == ("typical", 0.09, True)
    assert (pthresh.kind, pthresh.theta) == ("pthresh", 0.4)
    assert (topk.kind, topk.theta, topk.tree) == ("topk", 3.0, True)


def test_tree_suffix_keeps_the_theta():
    plain, tree = parse_methods("plain,mars@0.95+tree", 0.9)
    assert not plain.tree
    assert (tree.name, tree.kind, tree.theta, tree.tree) == ("mars@0.95+tree", "mars", 0.95, True)


def test_sampled_bench_shares_seeds_limits_plain_and_reports_intervals(decoder, tmp_path):
    spec = "plain,strict,mars-prob@0.3,hf-assisted"
    cfg = replace(config(spec), temperature=0.8, samples=2, plain_limit=1)
    questions = load_task("gsm8k", 2)
    seen = []

    def length_score(question, texts):  # 12 tokens solve no GSM8K question; any positive score will do
        return {"score": min(1.0, len(texts[0]) / 100)}

    summary = run_bench(
        decoder,
        questions,
        parse_methods(spec, 0.9),
        cfg,
        tmp_path,
        length_score,
        on_done=lambda q, m, sample, skipped: seen.append((q.qid, m.name, sample)),
    )
    # 2 questions x 2 samples x 4 methods, less plain's 2 decodes of the second question.
    assert len(seen) == len(load_records(tmp_path)) == 14
    assert not any(m == "plain" and q == questions[1].qid for q, m, _ in seen)
    records = load_records(tmp_path)
    for q in questions:
        for sample in range(2):
            seeds = {tuple(records[q.qid, m, sample]["seeds"]) for m in ("strict", "mars-prob@0.3")}
            assert len(seeds) == 1 and None not in next(iter(seeds))  # one seed per (question, sample)
    assert records[questions[0].qid, "strict", 0]["seeds"] != records[questions[0].qid, "strict", 1]["seeds"]
    assert records[questions[0].qid, "mars-prob@0.3", 0]["margin"] == "prob_ratio"

    assert summary["quality_reference"] == "strict" and summary["baseline"] == "plain"
    assert summary["questions"] == 2 and summary["samples"] == 2
    strict, plain = summary["methods"]["strict"], summary["methods"]["plain"]
    assert strict["questions"] == 2 and strict["decodes"] == 4 and plain["questions"] == 1
    assert summary["methods"]["mars-prob@0.3"]["speed_questions"] == 1  # paired with plain's question
    assert strict["speedup_vs_strict"] == 1.0  # strict against itself, whatever the speed baseline
    for m in summary["methods"].values():
        lo, hi = m["score_ci"]
        assert lo <= m["score"] <= hi
    assert strict["recovery"] == 1.0 and strict["recovery_ci"] == [1.0, 1.0]
    check = summary["strict_minus_plain"]
    assert check["questions"] == 1 and check["lo"] <= check["value"] <= check["hi"]
    text = (tmp_path / "summary.md").read_text()
    assert "temperature 0.8, 2 samples" in text and "Strict minus plain" in text
    assert "pareto.png" in {p.name for p in make_report(tmp_path)}

    # A calibration read from this run ranks MARS by its speed against strict, not against plain.
    (candidate,) = choice_from_runs([tmp_path], 0.99)[1].table
    assert candidate.speedup_vs_strict == summary["methods"]["mars-prob@0.3"]["speedup_vs_strict"]
    for metrics in summary["methods"].values():
        del metrics["speedup_vs_strict"]  # as a summary written before the field existed
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(MarspecError, match="--resummarize"):
        choice_from_runs([tmp_path], 0.99)


def test_the_rules_table_scores_a_sampled_question_by_its_mean_over_samples(decoder, tmp_path):
    spec = "strict,mars-prob@0.3"
    cfg = replace(config(spec), temperature=1.0, samples=2)
    questions = load_task("gsm8k", 2)

    def length_score(question, texts):  # 12 tokens solve no GSM8K question: a score that varies per sample
        return {"score": min(1.0, len(texts[0]) / 100)}

    run_bench(decoder, questions, parse_methods(spec, 0.9), cfg, tmp_path, length_score)
    records = load_records(tmp_path)
    means = {
        m: {q.qid: (records[q.qid, m, 0]["score"] + records[q.qid, m, 1]["score"]) / 2 for q in questions}
        for m in ("strict", "mars-prob@0.3")
    }
    # The samples must differ somewhere, or a table reading one sample per question would pass too.
    assert any(len({records[q.qid, "strict", s]["score"] for s in (0, 1)}) == 2 for q in questions)
    lines, _, _ = rules_table.rows([tmp_path])
    cells = {line.split(" (")[0].removeprefix("| "): line.split(" | ") for line in lines}
    for m, by_q in means.items():
        passed, n = cells[m][4].split("/")
        assert float(passed) == pytest.approx(sum(by_q.values()), rel=1e-3) and n == "2"
        lost = sum(means["strict"][q] > by_q[q] for q in by_q)
        won = sum(means["strict"][q] < by_q[q] for q in by_q)
        assert cells[m][5] == f"{lost} / {won}"
        # The exchange test reads each sample, not only each question's mean.
        qids = sorted(q.qid for q in questions)
        samples = {name: [[records[q, name, s]["score"] for s in (0, 1)] for q in qids] for name in means}
        assert cells[m][7] == f"{exchange_p_value(samples[m], samples['strict']):.2g}"


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"samples": 0}, "--samples"),
        ({"samples": 2}, "needs --temperature"),
        ({"plain_limit": 0}, "--plain-limit"),
    ],
)
def test_bad_sampling_settings(changes, needle):
    with pytest.raises(MarspecError, match=needle):
        replace(config("plain,strict"), **changes)


def test_old_configs_without_sampling_fields_still_resume(tmp_path):
    cfg = config("plain,strict")
    prepare_out_dir(tmp_path, cfg)
    path = tmp_path / "config.json"
    old = json.loads(path.read_text())
    for key in ("temperature", "samples", "plain_limit"):
        del old[key]
    path.write_text(json.dumps(old))
    prepare_out_dir(tmp_path, cfg)  # a greedy run from before sampling existed is the same configuration
    with pytest.raises(MarspecError, match="temperature"):
        prepare_out_dir(tmp_path, replace(cfg, temperature=1.0))


def test_first_difference_is_where_two_token_sequences_part():
    from marspec.eval.compare import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one ends: they part where it does


def test_compare_two_runs_pairs_questions(decoder, tmp_path):
    from marspec.eval.compare import compare_runs, parse_side

    def length_score(question, texts):
        return {"score": min(1.0, len(texts[0]) / 100)}

    questions = load_task("gsm8k", 2)
    for name, spec in (("a", "strict"), ("b", "strict,mars@0.5")):
        run_bench(
            decoder,
            questions[: 1 + (name == "b")],
            parse_methods(spec, 0.9),
            config(spec),
            tmp_path / name,
            length_score,
        )
    same = compare_runs(parse_side(f"{tmp_path / 'a'}:strict"), parse_side(f"{tmp_path / 'b'}:strict"))
    assert same.questions == 1 and same.changed == 0 and same.recovery.value == 1.0  # fp32 strict is exact
    assert same.first_divergences == ()
    other = compare_runs((tmp_path / "a", "strict"), (tmp_path / "b", "mars@0.5"))
    assert other.questions == 1 and other.lost + other.won <= other.changed
    assert len(other.first_divergences) == other.changed  # one token sequence per text, here
    with pytest.raises(MarspecError, match="RUN_DIR:METHOD"):
        parse_side("no-colon")
    with pytest.raises(MarspecError, match="no records of method"):
        compare_runs((tmp_path / "a", "strict"), (tmp_path / "b", "plain"))
