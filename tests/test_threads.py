"""Loading in a passing thread (marspec.backends.threads), so that the thread that decodes keeps the only
OpenMP team, with the load's result, exception and thread count the caller's."""

from __future__ import annotations

import threading

import pytest
import torch

import marspec.api
from marspec import Decoder
from marspec.backends.threads import in_passing_thread


def test_the_work_runs_in_another_thread_and_its_result_comes_back() -> None:
    caller = threading.get_ident()
    assert in_passing_thread(lambda: threading.get_ident()) != caller
    assert in_passing_thread(lambda: [1, 2]) == [1, 2]


def test_the_works_exception_is_raised_in_the_caller() -> None:
    failure = ValueError("the weights are damaged")

    def work() -> None:
        raise failure

    with pytest.raises(ValueError) as raised:
        in_passing_thread(work)
    assert raised.value is failure


def test_the_work_runs_at_the_callers_torch_thread_count() -> None:
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    torch.set_num_threads(wanted)
    try:
        assert in_passing_thread(torch.get_num_threads) == wanted
    finally:
        torch.set_num_threads(before)


def test_a_decoder_loads_its_models_outside_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded_in: list[int] = []
    load_lm = marspec.api.load_lm

    def recorded(*args, **kwargs):
        loaded_in.append(threading.get_ident())
        return load_lm(*args, **kwargs)

    monkeypatch.setattr(marspec.api, "load_lm", recorded)
    decoder = Decoder("smollm2-135m-instruct", "ngram", dtype="fp32")
    assert loaded_in and threading.get_ident() not in loaded_in
    assert decoder.generate("Say hi.", max_new_tokens=3).stats.new_tokens == 3
