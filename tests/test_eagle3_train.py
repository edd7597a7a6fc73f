"""``python -m marspec.eagle3_training`` on a tiny random target and a tiny text: it collects shards, trains
rounds, leaves a run that resumes where it stopped (no shard collected twice, the round count going on),
refuses to resume with settings its shards were not made with, saves a head marspec loads and drafts
with, and learns: on a text it sees again and again, the head's loss against the target falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marspec.api import Decoder
from marspec.eagle3_training.cli import main
from marspec.selftest import save_tiny_model, tiny_model

TEXT = "def add(a, b): return a + b; print(add(2, 3)); " * 5  # the tiny tokenizer has no newline


def args(run: Path, target: Path, corpus: Path, rounds: int, **changes) -> list[str]:
    settings = {
        "--run": run,
        "--target": target,
        "--corpus": corpus,
        "--dtype": "fp32",
        "--chunk": 48,
        "--shard-chunks": 2,
        "--per-doc": 1,
        "--top": 4,
        "--draft-vocab": 40,
        "--intermediate": 32,
        "--steps": 2,
        "--lr": 3e-3,
        "--epochs": 4,
        "--replay": 1,
        "--rounds": rounds,
        "--threads": torch.get_num_threads(),  # main() sets torch's threads: leave them as they are
        **changes,
    }
    return [str(item) for pair in settings.items() for item in pair]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_training_collects_trains_resumes_and_learns_a_memorised_text(tmp_path):
    target = save_tiny_model(tmp_path / "target", tiny_model(seed=0, layers=4))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):  # one text, memorised: every shard (the held-out one too) holds it
        (corpus / f"doc{i}.txt").write_text(TEXT)
    run = tmp_path / "run"

    main(args(run, target, corpus, rounds=2))
    state = json.loads((run / "state.json").read_text())
    assert state["round"] == 2
    assert state["tokens_trained"] == 4 * 2 * 48 + (4 + 1) * 2 * 48  # round 1 has nothing to replay
    assert sorted(p.name for p in (run / "shards").iterdir()) == [f"{i:05d}.safetensors" for i in range(3)]
    assert (run / "head" / "config.json").exists() and (run / "optimizer.pt").exists()
    first = records(run)
    assert [r["event"] for r in first] == ["collect", "eval", "collect", "train", "collect", "train"]

    main(args(run, target, corpus, rounds=5))
    log = records(run)
    resumed = log[len(first) :]
    assert [r["event"] for r in resumed] == ["collect", "train"] * 3  # shards 0-2 are not collected again
    assert [r["round"] for r in resumed if r["event"] == "train"] == [3, 4, 5]
    assert json.loads((run / "state.json").read_text())["round"] == 5
    before = log[1]["eval_loss"][0]  # the untrained head, round 0
    after = log[-1]["eval_loss"][0]
    assert after < 0.5 * before, f"the head's loss on a memorised text went from {before} to {after} only"
    assert log[-1]["eval_acc"][0] > log[1]["eval_acc"][0]

    # The head is a published-format head: marspec drafts with it, and strict stays exact.
    plain = Decoder(str(target), None, device="cpu").generate(
        "def add(", rule="plain", max_new_tokens=12, chat=False
    )
    eagle = Decoder(str(target), str(run / "head"), device="cpu", draft_confidence=0.0)
    result = eagle.generate("def add(", rule="strict", k=3, max_new_tokens=12, chat=False)
    assert result.token_ids == plain.token_ids


def test_a_run_refuses_to_resume_with_other_shard_settings(tmp_path):
    target = save_tiny_model(tmp_path / "target", tiny_model(seed=0, layers=4))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(TEXT)
    run = tmp_path / "run"
    main(args(run, target, corpus, rounds=1, **{"--shard-chunks": 1, "--epochs": 1}))
    with pytest.raises(SystemExit, match="was started with other settings"):
        main(args(run, target, corpus, rounds=2, **{"--shard-chunks": 1, "--chunk": 32}))
