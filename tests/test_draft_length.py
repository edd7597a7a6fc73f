"""The draft length and stop chosen at load from measured costs, on tiny random models (no speed is
asserted: the measurements of a machine shared with other work are whatever they are)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marspec import Decoder, GenerationOptions, MarspecError
from marspec.cli.run import draft_length_note
from marspec.draft_length import (
    ENV,
    PairKey,
    busy_note,
    decide,
    measure,
    measuring_allowed,
    store,
    stored_choices,
)
from marspec.draft_length.measure import Measured
from marspec.selftest.tiny import noisy_copy, save_tiny_model, tiny_model


@pytest.fixture(scope="module")
def pair_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-pair")
    target = tiny_model(seed=0)
    save_tiny_model(folder / "target", target)
    save_tiny_model(folder / "draft", noisy_copy(target, seed=1))
    return folder


@pytest.fixture
def measuring(monkeypatch, tmp_path) -> Path:
    """Measuring on, its measurements stored in a folder of this test's own (the rest of the model cache,
    the built kernels included, stays the user's)."""
    monkeypatch.setenv(ENV, "on")
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(measure, "REPEATS", 1)  # a test checks what is measured and kept, not a speed
    monkeypatch.setattr(measure, "NEW_TOKENS", 24)
    return tmp_path


def load(folder: Path, **settings) -> Decoder:
    return Decoder(
        str(folder / "target"), str(folder / "draft"), dtype="fp32", threads=1, lookup=False, **settings
    )


def test_a_pair_measures_once_then_reads_its_costs_back(pair_folder, measuring, monkeypatch) -> None:
    first = load(pair_folder)
    choice = first.draft_choice
    assert choice is not None and choice.source == "measured"
    assert 1 <= choice.k <= 15 and set(choice.costs.target) == set(range(1, 17))
    assert first.draft_stop == choice.stop
    assert first.settle(GenerationOptions()).k == choice.k  # unset: the choice
    assert first.settle(GenerationOptions(k=3)).k == 3  # named: the user's
    assert "target step" in choice.explain() and "draft step" in choice.explain()
    stored = list((measuring / "draft-length").glob("*.json"))
    assert len(stored) == 1
    # Speculative decoding with the chosen setting still returns the target's own greedy text.
    strict = first.generate("def f(x):", rule="strict", max_new_tokens=24, chat=False)
    plain = first.generate("def f(x):", rule="plain", max_new_tokens=24, chat=False)
    assert strict.token_ids == plain.token_ids
    again = load(pair_folder).draft_choice
    assert again is not None and again.source == "cached"
    assert (again.k, again.stop) == (choice.k, choice.stop)
    # What the demo's header and the self-test say.
    assert draft_length_note(first, None) == f"draft length: {choice.explain()}"
    assert draft_length_note(first, 5).startswith(f"draft length: k=5 named; the costs favour k={choice.k}")
    assert again.explain() in stored_choices(stored_cpu(stored[0]))
    monkeypatch.setenv(ENV, "again")  # measured anew, the stored measurements replaced
    anew = load(pair_folder).draft_choice
    assert anew is not None and anew.source == "measured"
    assert anew.explain().replace("(measured)", "(cached)") in stored_choices(stored_cpu(stored[0]))


def stored_cpu(path: Path) -> str:
    """The processor a stored measurement names."""
    return json.loads(path.read_text())["key"]["cpu"]


def test_a_named_stop_measures_nothing(pair_folder, measuring) -> None:
    decoder = load(pair_folder, draft_confidence=0.3)  # the user tunes the draft: k stays the default
    assert decoder.draft_choice is None and decoder.draft_stop == 0.3
    assert decoder.settle(GenerationOptions()).k == 8
    assert not (measuring / "draft-length").exists()


def test_off_keeps_the_fixed_defaults(pair_folder, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(ENV, "off")
    monkeypatch.setattr(store, "cache_dir", lambda: tmp_path)
    decoder = load(pair_folder)
    assert decoder.draft_choice is None and decoder.draft_stop == 0.55
    assert decoder.settle(GenerationOptions()).k == 8
    assert draft_length_note(decoder, None) == (
        "draft length: k=8, stop 0.55, fixed (chosen from measured costs only for a draft model on the CPU "
        "with no --draft-confidence named, unless MARSPEC_DRAFT_COSTS=off)"
    )
    assert stored_choices("any CPU") == f"{ENV}=off: every pair drafts with k 8, stop 0.55"
    assert not (tmp_path / "draft-length").exists()


def test_a_misspelt_switch_is_one_clear_line(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "of")
    with pytest.raises(MarspecError, match=f"{ENV}='of' is not understood: set it to 'off' .*'again'"):
        measuring_allowed()


def test_the_store_refuses_another_key_or_a_damaged_file(measuring) -> None:
    key = PairKey("cpu", 2, "avx2 0123abcd", "t", "q4k", "d", "q4k")
    measured = Measured({1: 0.05, 2: 0.06, 3: 0.08}, 0.02, [0.9, 0.4, 0.8], [True, False, True])
    store.save(key, measured)
    assert store.load(key) == measured
    assert store.load(PairKey("cpu", 1, "avx2 0123abcd", "t", "q4k", "d", "q4k")) is None  # other threads
    assert store.load(PairKey("cpu", 2, "avx2 4567cdef", "t", "q4k", "d", "q4k")) is None  # other kernels
    assert store.stored_on("cpu") == [(key, measured)]  # the self-test's report finds it by the CPU alone
    key.path().write_text("{not json")
    assert store.load(key) is None
    assert decide(measured).k in (1, 2)  # three rows measured: drafts of one or two tokens


def test_a_measurement_on_a_busy_machine_says_so(monkeypatch) -> None:
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert busy_note() == ""
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 1.0, 1.0))
    assert busy_note() == (
        "\nthe machine was busy while measuring (load 9.0 on 2 cores): run again with "
        f"{ENV}=again when it is quiet"
    )


def test_the_calibration_scores_the_drafts_rows_a_few_at_a_time_with_the_same_outcome(
    pair_folder, monkeypatch
) -> None:
    """The draft's confidences are read in forwards of a few rows (a row's logits are the vocabulary
    wide): the same tokens guessed as one forward over the whole continuation, and one entry per token."""
    decoder = load(pair_folder)
    drafter = decoder.drafter.model if hasattr(decoder.drafter, "model") else decoder.drafter
    prompt = decoder.prompt_ids("def f(x):", GenerationOptions(chat=False))
    prompts = [prompt, prompt[:1]]  # a one-token prompt leaves no row before its continuation
    monkeypatch.setattr(measure, "NEW_TOKENS", 12)
    record = {}
    for rows in (3, 1000):
        monkeypatch.setattr(measure, "ROWS_AT_ONCE", rows)
        record[rows] = measure.draft_record(decoder.target, drafter, prompts, decoder.eos_token_ids)
    (few, few_ok), (all_, all_ok) = record[3], record[1000]
    assert few_ok == all_ok and len(few) == 24
    assert few == pytest.approx(all_, abs=1e-5)
