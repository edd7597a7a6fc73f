"""benchmarks/engines.py's rounds: each engine's median rate and each round's ratio to llama.cpp's plain
rate in that same round (the drift of a shared machine between rounds must not enter a ratio)."""

from __future__ import annotations

from types import ModuleType

import pytest
from conftest import benchmark_module


@pytest.fixture(scope="module")
def engines() -> ModuleType:
    return benchmark_module("engines")


def row(rate: float, peak: float | None = 1.5, **extra: float) -> dict:
    return {"tokens_per_s": rate, "peak_gib": peak, **extra}


def test_each_rounds_ratio_is_taken_within_the_round(engines: ModuleType) -> None:
    llama = engines.LLAMA_PLAIN
    rounds = [
        {llama: row(20.0), "marspec default strict": row(30.0, tau=3.5)},  # a fast machine for both
        {llama: row(10.0), "marspec default strict": row(16.0, peak=2.0)},  # both slowed by a neighbour
        {llama: row(15.0), "marspec default strict": row(21.0)},
    ]
    combined = engines.combine_rounds(rounds)
    strict = combined["marspec default strict"]
    assert strict["rounds_vs_llama_plain"] == pytest.approx([1.5, 1.6, 1.4])
    assert strict["tokens_per_s"] == 21.0  # the median rate
    assert strict["rounds_tokens_per_s"] == [30.0, 16.0, 21.0]
    assert strict["peak_gib"] == 2.0  # the largest of the rounds
    assert strict["tau"] == 3.5  # the rest from the first round
    assert combined[llama]["rounds_vs_llama_plain"] == [1.0, 1.0, 1.0]


def test_a_row_without_llama_cpp_beside_it_has_no_ratio(engines: ModuleType) -> None:
    combined = engines.combine_rounds([{"marspec default plain": row(25.0, peak=None)}])
    assert combined["marspec default plain"]["rounds_vs_llama_plain"] == []
    assert combined["marspec default plain"]["peak_gib"] is None
