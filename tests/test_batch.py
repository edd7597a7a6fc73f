"""Several sequences decoded together (issue 69): packed forwards, the batch scheduler, generate_many.

The oracle everywhere is the sequence decoded alone: on the engines whose rows are computed alone (int8
target, 4-bit draft) each sequence's tokens must equal its solo run's bit for bit, whatever shares its
forwards, joins or leaves beside it; elsewhere forwards run one sequence at a time, also exactly.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from marspec.backends.int8 import rowwise_int8_available
from marspec.backends.packed import forward_packed, rows_alone
from marspec.batch.scheduler import (
    PREFILL_CHUNK,
    Scheduler,
    batched_draft_len,
    default_max_batch,
    shares_forwards,
)
from marspec.defaults import MAX_K
from marspec.draft_length import DraftChoice
from marspec.draft_length.cost_model import Acceptance, Costs, predict
from marspec.errors import MarspecError
from marspec.selftest.tiny import tiny_decoder

needs_int8 = pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8 kernels on this CPU")

PROMPTS = [f"count {i}: " + "ab " * (3 + 2 * i) for i in range(6)]
# One prompt's own settings each: rules, k, temperature, seeds and lengths differ inside one batch.
MIXED = [
    {"rule": "strict"},
    {"rule": "mars", "theta": 0.3},
    {"rule": "plain", "max_new_tokens": 17},
    {"rule": "mars", "theta": 0.3, "temperature": 1.0, "seed": 5},
    {"rule": "strict", "k": 3, "max_new_tokens": 9},
    {"rule": "plain", "temperature": 0.7, "seed": 9},
]


@pytest.fixture(scope="module")
def int8_decoder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny pair on the CPU's default engine: an int8 target and a 4-bit draft, both row-alone."""
    if not rowwise_int8_available():
        pytest.skip("no oneDNN int8 kernels on this CPU")
    return tiny_decoder(tmp_path_factory.mktemp("tiny-int8"), torch.device("cpu"), target_quant="int8")


@pytest.fixture(scope="module")
def fp32_decoder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny pair in fp32: rows computed together, so never packed."""
    return tiny_decoder(tmp_path_factory.mktemp("tiny-fp32"), torch.device("cpu"))


def solo(decoder, prompts, per_prompt, **shared):
    return [decoder.generate(p, **{**shared, **o}) for p, o in zip(prompts, per_prompt, strict=True)]


@needs_int8
def test_a_packed_forward_gives_each_sequence_its_own_forwards_bits(int8_decoder) -> None:
    base = int8_decoder.target
    lms = [type(base)(base.model, base.tokenizer, base.name) for _ in range(4)]  # two packed, two alone
    assert all(rows_alone(lm) for lm in lms)
    ids = torch.Generator().manual_seed(0)
    for n_a, n_b, last_a in ((7, 12, True), (3, 1, False), (1, 13, False)):
        a, b = (torch.randint(0, 60, (n,), generator=ids) for n in (n_a, n_b))
        packed_a, packed_b = forward_packed([(lms[0], a, last_a), (lms[1], b, False)])
        assert torch.equal(packed_a, lms[2].forward(a, last_only=last_a))
        assert torch.equal(packed_b, lms[3].forward(b))
    assert [lm.cached_len for lm in lms] == [11, 26, 11, 26]
    for packed, alone in ((lms[0], lms[2]), (lms[1], lms[3])):
        for layer_p, layer_a in zip(packed.cache_layers, alone.cache_layers, strict=True):
            assert torch.equal(layer_p.keys, layer_a.keys) and torch.equal(layer_p.values, layer_a.values)


@needs_int8
def test_what_packs_the_int8_target_and_4bit_draft_not_fp32_nor_a_model_keeping_states(
    int8_decoder, fp32_decoder
) -> None:
    assert rows_alone(int8_decoder.target) and rows_alone(int8_decoder.drafter.draft_model)
    assert shares_forwards(int8_decoder.target) and default_max_batch(int8_decoder.target) >= 4
    assert not rows_alone(fp32_decoder.target) and not shares_forwards(fp32_decoder.target)
    assert default_max_batch(fp32_decoder.target) == 1
    base = int8_decoder.target
    keeping = type(base)(base.model, base.tokenizer, base.name)
    keeping.capture_hidden_states((1,))
    assert not rows_alone(keeping)  # a packed forward writes no hidden states


@needs_int8
def test_generate_many_equals_each_prompt_decoded_alone_with_mixed_settings_and_staggered_starts(
    int8_decoder,
) -> None:
    shared = {"max_new_tokens": 32, "chat": False}
    expected = solo(int8_decoder, PROMPTS, MIXED, **shared)
    # Three slots for six prompts: the later ones join as earlier ones finish, at different steps.
    got = int8_decoder.generate_many(PROMPTS, max_batch=3, per_prompt=MIXED, **shared)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    assert [r.relaxed_positions for r in got] == [r.relaxed_positions for r in expected]
    assert any(r.relaxed_positions for r in got)  # MARS relaxed inside the batch, as alone


@needs_int8
def test_inside_a_batch_strict_equals_plain_and_mars_at_theta_one_equals_strict(int8_decoder) -> None:
    prompt = PROMPTS[3]
    rules = [{"rule": "plain"}, {"rule": "strict"}, {"rule": "mars", "theta": 1.0}, {"rule": "block"}]
    got = int8_decoder.generate_many([prompt] * 4, per_prompt=rules, max_new_tokens=40, chat=False)
    assert len({tuple(r.token_ids) for r in got}) == 1
    assert got[1].stats.drafted > 0  # speculation ran


def test_a_batch_shortens_drafts_as_it_grows_and_a_sequence_alone_keeps_its_k() -> None:
    assert batched_draft_len(1) == MAX_K
    assert [batched_draft_len(n) for n in (2, 3, 4, 5, 8)] == [5, 3, 2, 0, 0]


def test_a_batch_drafts_none_where_the_measured_costs_expect_one_row_each_to_be_faster() -> None:
    acceptance = Acceptance(0.55, 0.76, 0.94, 0.35)  # the default pair's on its calibration text
    # A 2-core Zen 4's costs (ms by rows, the draft's step): rows past four cost most of a step each.
    target = {1: 35.3, 2: 35.3, 3: 36.1, 4: 36.6, 5: 40.6, 6: 45.3, 7: 49.5, 8: 54.7, 9: 60.3, 10: 67.6}
    target |= {11: 77.8, 12: 80.2, 13: 85.7, 14: 94.9, 15: 101.0, 16: 108.3}
    zen4 = Costs({n: ms / 1000 for n, ms in target.items()}, 0.0128)
    choice = DraftChoice(3, 0.55, predict(3, acceptance, zen4), zen4, acceptance, "measured")
    assert [batched_draft_len(n, choice) for n in (1, 2, 3, 4, 5)] == [MAX_K, 5, 3, 0, 0]
    cheap = Costs({n: (35.3 + 0.3 * (n - 1)) / 1000 for n in range(1, 17)}, 0.0128)  # rows nearly free
    choice = DraftChoice(3, 0.55, predict(3, acceptance, cheap), cheap, acceptance, "measured")
    assert [batched_draft_len(n, choice) for n in (2, 3, 4)] == [5, 3, 2]


@needs_int8
def test_greedy_lossless_sequences_draft_less_in_a_batch_and_decode_as_alone_lossy_ones_keep_k(
    int8_decoder,
) -> None:
    rules = [{"rule": "strict"}, {"rule": "block"}, {"rule": "mars", "theta": 0.3}, {"rule": "strict"}]
    prompts = PROMPTS[:4]
    expected = solo(int8_decoder, prompts, rules, max_new_tokens=24, chat=False)
    got = int8_decoder.generate_many(prompts, per_prompt=rules, max_batch=4, max_new_tokens=24, chat=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    cap = batched_draft_len(4)  # all four join before the first forward
    for lossless in (got[0], got[1], got[3]):
        assert lossless.stats.steps[0].drafted <= cap
    assert max(step.drafted for step in expected[0].stats.steps) > cap  # alone, a longer draft
    # The lossy rule's drafts shape its answer: it drafts in the batch exactly as alone.
    assert [s.drafted for s in got[2].stats.steps] == [s.drafted for s in expected[2].stats.steps]


@needs_int8
def test_a_prompt_longer_than_a_prefill_chunk_is_scored_in_chunks_beside_the_others(int8_decoder) -> None:
    long_prompt = "xy " * 50  # one token a character: 150 tokens, in a context of 256
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    assert int8_decoder.prompt_ids(long_prompt, int8_decoder_options(chat=False)).shape[0] > PREFILL_CHUNK
    expected = solo(int8_decoder, prompts, [{}] * 3, max_new_tokens=20, chat=False)
    got = int8_decoder.generate_many(prompts, max_batch=3, max_new_tokens=20, chat=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def int8_decoder_options(**options):
    from marspec.settings import GenerationOptions

    return GenerationOptions.of(options)


@needs_int8
def test_stream_many_streams_each_prompts_text_and_a_closed_stream_ends_its_threads(int8_decoder) -> None:
    stream = int8_decoder.stream_many(PROMPTS[:3], max_new_tokens=16, chat=False)
    texts = ["", "", ""]
    for index, delta in stream:
        texts[index] += delta
    assert stream.results is not None and texts == [r.text for r in stream.results]
    before = threading.active_count()
    early = int8_decoder.stream_many(PROMPTS, max_new_tokens=64, chat=False)
    next(iter(early))
    early.close()  # every sequence stops where it waits for a forward
    assert threading.active_count() <= before


def test_forwards_that_cannot_be_packed_run_one_sequence_at_a_time_exactly(fp32_decoder) -> None:
    shared = {"max_new_tokens": 24, "chat": False}
    expected = solo(fp32_decoder, PROMPTS[:4], MIXED[:4], **shared)
    got = fp32_decoder.generate_many(PROMPTS[:4], max_batch=4, per_prompt=MIXED[:4], **shared)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def test_bad_batch_input_gets_one_line_before_any_decoding(fp32_decoder) -> None:
    for call, needle in (
        (lambda: fp32_decoder.generate_many(PROMPTS, max_batch=0), "max_batch"),
        (lambda: fp32_decoder.generate_many(PROMPTS, per_prompt=[{}]), "per_prompt has 1 entries for 6"),
        (lambda: fp32_decoder.generate_many("one prompt"), "prompts must be a list"),
        (lambda: fp32_decoder.generate_many(PROMPTS, per_prompt=[{"k": 0}] * 6), "k (draft length)"),
        (lambda: fp32_decoder.generate_many(["x " * 400]), "shorten the prompt"),
    ):
        with pytest.raises(MarspecError) as caught:
            call()
        assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_one_at_a_time_the_fixed_shape_pair_decodes_through_the_scheduler_as_itself(tmp_path: Path) -> None:
    decoder = tiny_decoder(tmp_path, torch.device("cpu"), graphs="on")
    # One at a time needs no slots of its own: the fixed-shape pair decodes through the scheduler as itself.
    scheduler = Scheduler(decoder.target, decoder.drafter, max_batch=1)
    assert scheduler.max_batch == 1
    got = decoder.generate_many(PROMPTS[:2], max_batch=1, max_new_tokens=8, chat=False)
    assert [r.token_ids for r in got] == [
        r.token_ids for r in solo(decoder, PROMPTS[:2], [{}, {}], max_new_tokens=8, chat=False)
    ]


def test_one_thread_runs_every_forward_and_every_sequences_loop(fp32_decoder, monkeypatch) -> None:
    """Sequences are data the scheduler advances: no thread is started, and every model forward runs in
    the thread that steps the batch."""
    threads: set[int] = set()
    forward = type(fp32_decoder.target).forward

    def recorded(self, tokens, last_only=False):
        threads.add(threading.get_ident())
        return forward(self, tokens, last_only)

    monkeypatch.setattr(type(fp32_decoder.target), "forward", recorded)
    started = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: pytest.fail("a thread was started"))
    try:
        got = fp32_decoder.generate_many(PROMPTS[:3], max_batch=3, max_new_tokens=6, chat=False)
    finally:
        monkeypatch.setattr(threading.Thread, "start", started)
    assert threads == {threading.get_ident()} and all(r.token_ids for r in got)
