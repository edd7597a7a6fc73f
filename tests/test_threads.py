"""Threads and torch's thread count (marspec.backends.threads): loading in a passing thread, so that the
thread that decodes keeps the only OpenMP team, with the load's result, exception and thread count the
caller's; a thread's own count held whatever other threads set; a batch's dispatcher and sequences."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch

import marspec.api
from marspec import Decoder
from marspec.backends.threads import hold_thread_count, in_passing_thread
from marspec.batch.batcher import Batcher
from marspec.batch.scheduler import Scheduler
from marspec.selftest.tiny import tiny_decoder
from marspec.settings import GenerationOptions


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


def in_fresh_thread(work):
    """``work()`` in a new thread (one that has not read its torch thread count yet); its result."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join()
    return out[0]


def test_a_held_thread_count_stays_when_another_thread_sets_its_own_later() -> None:
    before = torch.get_num_threads()
    try:
        held = threading.Event()
        other_set = threading.Event()

        def holder() -> int:
            hold_thread_count(3)
            held.set()
            other_set.wait()
            return torch.get_num_threads()

        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(holder()))
        thread.start()
        held.wait()
        in_fresh_thread(lambda: torch.set_num_threads(1))
        other_set.set()
        thread.join()
        assert result == [3]
    finally:
        torch.set_num_threads(before)


def test_a_batchs_forwards_run_at_the_dispatchers_count_and_its_sequences_on_one_thread(
    tmp_path: Path,
) -> None:
    """The server's arrangement: the dispatcher, a thread of its own, runs its first forward only after
    the sequences' threads have set theirs; its forwards keep its count, and threads started afterwards
    get it too."""
    before = torch.get_num_threads()
    decoder = tiny_decoder(tmp_path, torch.device("cpu"), target_quant="int8")
    seen: dict[str, set[int]] = {"dispatcher": set(), "sequence": set()}
    run_once = Batcher.run_once

    def recording_run_once(self: Batcher) -> int:
        seen["dispatcher"].add(torch.get_num_threads())
        return run_once(self)

    def dispatch() -> int:
        hold_thread_count(3)
        scheduler = Scheduler(decoder.target, decoder.drafter, max_batch=2)
        done: list[int] = []

        def work(slot) -> None:
            seen["sequence"].add(torch.get_num_threads())
            gen = decoder.decode_on(slot, "ab ab ab", GenerationOptions.of({"max_new_tokens": 6}), False)
            with contextlib.suppress(StopIteration):
                while True:
                    next(gen)
            done.append(1)

        scheduler.add(work)
        scheduler.add(work)
        while len(done) < 2:
            scheduler.step()
        scheduler.close()
        return in_fresh_thread(torch.get_num_threads)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Batcher, "run_once", recording_run_once)
            later_thread_count = in_fresh_thread(dispatch)
    finally:
        torch.set_num_threads(before)
    assert seen == {"dispatcher": {3}, "sequence": {1}}
    assert later_thread_count == 3
