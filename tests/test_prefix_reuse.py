"""Prefix reuse on tiny random models: a prompt that starts like the cached sequence keeps that prefix,
and decoding after a kept prefix gives the tokens a fresh prefill gives (real weights: test_real.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, decode_tokens, tiny_lm

from marspec.backends.quantize import quantize_int8
from marspec.decode import DecodeConfig
from marspec.drafters import ModelDrafter, NgramDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule


def next_turn(prompt: torch.Tensor, output: list[int], user: list[int]) -> torch.Tensor:
    """The second turn of a conversation: everything so far, then the user's new tokens."""
    return torch.cat((prompt, torch.tensor(output), torch.tensor(user)))


def test_the_next_turn_keeps_the_conversation_and_decodes_as_a_fresh_prefill(target, prompt):
    first, _ = decode_tokens(target, None, prompt, max_new_tokens=12)
    second_prompt = next_turn(prompt, first, [3, 9, 27])
    reused, stats = decode_tokens(target, None, second_prompt, max_new_tokens=12)
    # The cache held the prompt and the output but its last (pending) token.
    assert stats.reused_tokens == len(prompt) + len(first) - 1
    fresh, fresh_stats = decode_tokens(target, None, second_prompt, max_new_tokens=12, reuse_prefix=False)
    assert fresh_stats.reused_tokens == 0
    assert reused == fresh


def test_only_the_shared_prefix_is_kept(target, prompt):
    decode_tokens(target, None, prompt, max_new_tokens=6)
    edited = prompt.clone()
    edited[5] = (edited[5] + 1) % TINY_VOCAB
    tokens, stats = decode_tokens(target, None, edited, max_new_tokens=10)
    assert stats.reused_tokens == 5
    assert target.cached_len == len(prompt) + 10 - 1
    assert tokens == decode_tokens(target, None, edited, max_new_tokens=10, reuse_prefix=False)[0]


def test_a_repeated_prompt_is_not_scored_again(target, prompt):
    first, _ = decode_tokens(target, None, prompt, max_new_tokens=8)
    again, stats = decode_tokens(target, None, prompt, max_new_tokens=8)
    assert stats.reused_tokens == len(prompt) - 1 and stats.prefill_s == 0.0
    assert again == first


def test_speculative_decoding_reuses_both_caches(target, prompt):
    draft_lm = tiny_lm(0, "same-weights")  # accepts everything: the draft cache runs ahead of the output
    drafter = ModelDrafter(draft_lm, target_vocab_size=target.vocab_size)
    first, _ = decode_tokens(target, drafter, prompt, rule=Rule("strict"), k=4, max_new_tokens=14)
    second_prompt = next_turn(prompt, first, [11, 12])
    calls = draft_lm.clock.calls
    reused, stats = decode_tokens(target, drafter, second_prompt, rule=Rule("strict"), k=4, max_new_tokens=14)
    assert stats.reused_tokens > len(prompt)
    # The draft model caught up on the new turn in its first forward instead of scoring it all.
    assert draft_lm.clock.calls - calls == stats.draft_forwards
    plain, _ = decode_tokens(target, None, second_prompt, max_new_tokens=14, reuse_prefix=False)
    assert reused == plain


def test_a_kept_prefix_after_tree_decoding_decodes_as_a_fresh_prefill(target, prompt):
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    first, _ = decode_tokens(
        target, drafter, prompt, rule=Rule("strict"), k=3, tree=(3, 2), max_new_tokens=16
    )
    second_prompt = next_turn(prompt, first, [40])
    reused, stats = decode_tokens(
        target, drafter, second_prompt, rule=Rule("strict"), k=3, tree=(3, 2), max_new_tokens=8
    )
    assert stats.reused_tokens == len(prompt) + len(first) - 1
    assert reused == decode_tokens(target, None, second_prompt, max_new_tokens=8, reuse_prefix=False)[0]


def test_a_lookup_drafter_works_after_a_kept_prefix(target, prompt):
    first, _ = decode_tokens(target, NgramDrafter(), prompt, rule=Rule("strict"), k=3, max_new_tokens=10)
    second_prompt = next_turn(prompt, first, [5, 17])
    reused, stats = decode_tokens(
        target, NgramDrafter(), second_prompt, rule=Rule("strict"), k=3, max_new_tokens=10
    )
    assert stats.reused_tokens > 0
    assert reused == decode_tokens(target, None, second_prompt, max_new_tokens=10, reuse_prefix=False)[0]


def test_sliding_window_layers_are_never_reused(prompt):
    lm = tiny_lm(0, "windowed", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not lm.reuses_prefix  # positions past the window are gone: a rollback could not restore them
    first, _ = decode_tokens(lm, None, prompt, max_new_tokens=6)
    again, stats = decode_tokens(lm, None, prompt, max_new_tokens=6)
    assert stats.reused_tokens == 0 and again == first


def test_an_int8_draft_rereads_the_prompt_while_the_target_keeps_its_cache(target, prompt):
    draft_lm = tiny_lm(0, "same-weights")
    quantize_int8(draft_lm.model)
    assert not draft_lm.reuses_prefix  # per-forward activation scales: its cache depends on chunking
    drafter = ModelDrafter(draft_lm, target_vocab_size=target.vocab_size)
    first, _ = decode_tokens(target, drafter, prompt, rule=Rule("strict"), k=4, max_new_tokens=10)
    second_prompt = next_turn(prompt, first, [11, 12])
    reused, stats = decode_tokens(target, drafter, second_prompt, rule=Rule("strict"), k=4, max_new_tokens=10)
    assert stats.reused_tokens == len(prompt) + len(first) - 1
    assert draft_lm.keep_prefix(second_prompt) == 0 and draft_lm.cached_len == 0
    assert reused == decode_tokens(target, None, second_prompt, max_new_tokens=10, reuse_prefix=False)[0]


def test_bad_reuse_flag_is_refused():
    with pytest.raises(MarspecError, match="reuse_prefix must be true or false"):
        DecodeConfig(rule=Rule(), k=4, max_new_tokens=8, reuse_prefix="yes")  # type: ignore[arg-type]
