"""The ``thinking`` guard (marspec.thinking): spans on hand-made token sequences, the guard on hand-made
logits for greedy and sampling, markers from a real tokenizer, its refusals, and through the loop on tiny
models: every relaxed accept lies inside a span, and a run wholly inside (outside) one equals the
unguarded rule (strict). The real pair, with markers given, is in tests/test_real.py."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_lm
from transformers import AutoTokenizer

from marspec.decode import DecodeConfig, decode
from marspec.drafters import ModelDrafter
from marspec.errors import MarspecError
from marspec.models import resolve_model_dir
from marspec.rules import Rule
from marspec.settings import GenerationOptions, Pair, settle
from marspec.stats import GenerationStats
from marspec.thinking import ThinkingMarkers, check_marker_strings, thinking_markers
from marspec.verify import verify_greedy, verify_sampling

START, END = 7, 8
MARKERS = ThinkingMarkers(start=START, end=END)
MARS = Rule("mars", 0.5, "prob_ratio")
GUARDED = Rule("mars", 0.5, "prob_ratio", guard="thinking")


def tok(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


@pytest.mark.parametrize(
    ("draft", "is_open", "inside"),
    [
        ((1, 2, 3), True, [True, True, True]),
        ((1, 2, 3), False, [False, False, False]),
        ((1, END, 3), True, [True, True, False]),  # the end marker's own position is still inside
        ((START, 2, END, 4), False, [False, True, True, False]),
        ((END, START, 5), True, [True, False, True]),
        ((), True, []),
    ],
)
def test_a_span_runs_from_after_a_start_marker_to_its_end_marker(draft, is_open, inside) -> None:
    assert MARKERS.span(tok(*draft), is_open).inside.tolist() == inside


def test_the_state_after_committed_tokens() -> None:
    assert MARKERS.open_after([1, START, 2]) and not MARKERS.open_after([START, 2, END, 3])
    assert MARKERS.open_after([1, 2], is_open=True) and not MARKERS.open_after([], is_open=False)


def test_markers_themselves_are_never_relaxed() -> None:
    span = MARKERS.span(tok(1, 2, 3), True)
    assert span.allows(tok(1, END, 3), tok(2, 2, START)).tolist() == [True, False, False]


# Row 0: a close call between tokens 0 and 1 (p1/p0 = 0.9); row 1 is the bonus row (token 3 on top).
CLOSE = [5.0, 4.9, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
BONUS = [0.0, 1.0, 2.0, 9.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_greedy_relaxes_inside_a_span_only() -> None:
    logits = torch.tensor([CLOSE, BONUS])
    assert verify_greedy(logits, tok(1), MARS).emitted() == [1, 3]
    inside = verify_greedy(logits, tok(1), GUARDED, span=MARKERS.span(tok(1), True))
    outside = verify_greedy(logits, tok(1), GUARDED, span=MARKERS.span(tok(1), False))
    assert inside.emitted() == [1, 3] and inside.n_relaxed == 1
    assert outside.emitted() == [0] and outside.n_relaxed == 0


def test_sampling_relaxes_inside_a_span_only() -> None:
    logits = torch.tensor([CLOSE, BONUS])
    q = torch.zeros(1, 9)
    q[0, 1] = 1.0  # the draft was sure of 1, which the target gives p = 0.47: the random test fails often
    for seed in range(30):
        g, h = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        inside = verify_sampling(logits, tok(1), q, GUARDED, 1.0, g, span=MARKERS.span(tok(1), True))
        outside = verify_sampling(logits, tok(1), q, GUARDED, 1.0, h, span=MARKERS.span(tok(1), False))
        strict = verify_sampling(logits, tok(1), q, Rule(), 1.0, torch.Generator().manual_seed(seed))
        assert inside.n_accepted == 1 and outside.emitted() == strict.emitted()


def test_the_guard_needs_its_span_and_a_chain() -> None:
    with pytest.raises(MarspecError, match="'thinking' guard needs the block's span"):
        verify_greedy(torch.tensor([CLOSE, BONUS]), tok(1), GUARDED)
    with pytest.raises(MarspecError, match="'thinking' guard follows its span along a draft chain"):
        GenerationOptions(rule="mars", guard="thinking", tree="2,2")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))


def test_markers_are_single_tokens_of_the_targets_vocabulary(tokenizer) -> None:
    vocab = tokenizer.get_vocab()
    markers = thinking_markers(tokenizer, ("<|im_start|>", "<|im_end|>"))
    assert (markers.start, markers.end) == (vocab["<|im_start|>"], vocab["<|im_end|>"])
    with pytest.raises(MarspecError, match="default markers '<think>', '</think>' are not single tokens"):
        thinking_markers(tokenizer, None)  # SmolLM2 is no reasoning model
    with pytest.raises(MarspecError, match="markers 'not one token' are not single tokens"):
        thinking_markers(tokenizer, ("<|im_start|>", "not one token"))


def test_bad_marker_options_are_refused_in_one_line(tokenizer) -> None:
    for bad in ("<think>", ("<think>",), ("<think>", ""), ("<think>", "<think>"), (1, 2)):
        with pytest.raises(MarspecError, match="give the span's start and end markers as two different"):
            check_marker_strings(bad)
    with pytest.raises(MarspecError, match="thinking markers are the 'thinking' guard's"):
        GenerationOptions(rule="mars", thinking=("<|im_start|>", "<|im_end|>"))
    pair = Pair(target="t", draft="d", tokenizer=tokenizer, vocab_size=len(tokenizer))
    config = settle(
        GenerationOptions(rule="mars", guard="thinking", thinking=("<|im_start|>", "<|im_end|>")), pair
    )
    assert config.thinking == thinking_markers(tokenizer, ("<|im_start|>", "<|im_end|>"))
    with pytest.raises(MarspecError, match="not a reasoning model's tokenizer"):
        settle(GenerationOptions(rule="mars", guard="thinking"), pair)


def _decode(target, drafter, prompt, rule, markers=None, temperature=0.0):
    config = DecodeConfig(rule=rule, k=4, max_new_tokens=40, temperature=temperature, thinking=markers)
    steps = list(decode(target, drafter, prompt, config, GenerationStats(), torch.Generator().manual_seed(0)))
    tokens = [t for s in steps for t in s.tokens]
    relaxed, offset = [], 0
    for s in steps:
        relaxed += [(offset + p, s.relaxed_top1[i]) for i, p in enumerate(s.relaxed_at) if p < len(s.tokens)]
        offset += len(s.tokens)
    return tokens, relaxed


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_through_the_loop_every_relaxed_accept_lies_inside_a_span(target, prompt, temperature) -> None:
    """Markers the tiny models write (48 and 80 recur in their text): spans open and close inside the
    generation, and the guard follows them across steps. Top-20 relaxes often enough to see it."""
    drafter = ModelDrafter(tiny_lm(2, "tiny-draft"), target_vocab_size=target.vocab_size)
    markers = ThinkingMarkers(start=48, end=80)
    tokens, relaxed = _decode(
        target, drafter, prompt, Rule("topk", 20, guard="thinking"), markers, temperature
    )
    assert relaxed and 48 in tokens and 80 in tokens  # not vacuous: spans open and close
    context = prompt.tolist()
    for position, top1 in relaxed:
        assert markers.open_after(context + tokens[:position])
        assert tokens[position] not in (48, 80) and top1 not in (48, 80)


def test_wholly_inside_a_span_is_the_unguarded_rule_and_outside_is_strict(target, prompt) -> None:
    drafter = ModelDrafter(tiny_lm(2, "tiny-draft"), target_vocab_size=target.vocab_size)
    loose, guarded = Rule("mars", 0.05, "prob_ratio"), Rule("mars", 0.05, "prob_ratio", guard="thinking")
    never = ThinkingMarkers(start=95, end=96)  # ids the tiny models do not write here
    inside = torch.cat([prompt, tok(95)])
    free, relaxed = _decode(target, drafter, inside, loose)
    assert relaxed and 96 not in free and _decode(target, drafter, inside, guarded, never)[0] == free
    strict, _ = _decode(target, drafter, prompt, Rule())
    assert _decode(target, drafter, prompt, guarded, never) == (strict, [])
