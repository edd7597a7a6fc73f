"""Cheaper drafting: confidence-stopped drafts, prompt lookup before the model, an int8 draft model."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_lm
from test_decode import reference_greedy, run

from marspec.backends.quantize import quantize_int8
from marspec.decode import DecodeConfig
from marspec.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule


def draft_confidences(lm, context: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """Greedy draft of k tokens without any cache, with the draft's top probability at each."""
    seq, conf = context.tolist(), []
    for _ in range(k):
        with torch.no_grad():
            probs = torch.softmax(lm.model(input_ids=torch.tensor([seq])).logits[0, -1], dim=-1)
        conf.append(float(probs.max()))
        seq.append(int(probs.argmax()))
    return seq[len(context) :], conf


def soft_lm(seed: int):
    """A tiny model whose random logits are NOT sharpened, so its confidences spread over (0, 1)."""
    lm = tiny_lm(seed, "soft")
    lm.model.lm_head.weight.div_(20.0)
    return lm


def test_draft_stops_after_the_first_unsure_token(prompt):
    lm = soft_lm(3)
    tokens, conf = draft_confidences(lm, prompt, 6)
    # A threshold between the confidences makes the draft end right after the first token below it.
    threshold = sorted(conf)[len(conf) // 2]
    first_unsure = next(i for i, c in enumerate(conf) if c < threshold)
    draft = ModelDrafter(lm, lm.vocab_size, min_confidence=threshold).propose(prompt, 6, 0.0, None)
    assert draft.tokens.tolist() == tokens[: first_unsure + 1]
    assert lm.cached_len == len(prompt) + first_unsure  # no forward was spent past the unsure token


def test_zero_confidence_drafts_all_k(prompt):
    lm = soft_lm(3)
    tokens, _ = draft_confidences(lm, prompt, 6)
    assert ModelDrafter(lm, lm.vocab_size).propose(prompt, 6, 0.0, None).tokens.tolist() == tokens


def test_confidence_out_of_range_is_refused():
    with pytest.raises(MarspecError, match="min_confidence"):
        ModelDrafter(tiny_lm(1), 97, min_confidence=1.5)


def test_confidence_stopped_drafts_keep_strict_equal_to_plain(target, prompt):
    drafter = ModelDrafter(soft_lm(1), target.vocab_size, min_confidence=0.05)
    spec, _, stats = run(target, drafter, prompt, rule=Rule("strict"), k=8, max_new_tokens=40)
    assert spec == reference_greedy(target, prompt, 40)
    drafted = [s.drafted for s in stats.steps]
    assert min(drafted) < 8  # the threshold really shortened some drafts


def test_sampling_with_short_drafts_stays_consistent(target, prompt):
    drafter = ModelDrafter(soft_lm(1), target.vocab_size, min_confidence=0.05)
    a, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=6, temperature=0.8, max_new_tokens=30)
    b, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=6, temperature=0.8, max_new_tokens=30)
    assert a == b and len(a) == 30


def test_hybrid_uses_lookup_when_the_context_repeats(prompt):
    model = ModelDrafter(tiny_lm(1), 97)
    hybrid = HybridDrafter(model, NgramDrafter(max_ngram=3, min_ngram=3))
    # prompt = [5, 17, 42, 8, 63, 5, 17, 42]: its tail "5 17 42" occurred before, followed by "8 63".
    draft = hybrid.propose(prompt, 2, 0.0, None)
    assert draft.tokens.tolist() == [8, 63]
    assert model.draft_model.cached_len == 0  # the model was not asked


def test_hybrid_falls_back_to_the_model_and_catches_up(prompt):
    model = ModelDrafter(tiny_lm(1), 97)
    hybrid = HybridDrafter(model, NgramDrafter(max_ngram=3, min_ngram=3))
    context = torch.cat((prompt, torch.tensor([1, 2, 3])))  # tail "1 2 3" never occurred before
    expected, _ = draft_confidences(model.draft_model, context, 3)
    assert hybrid.propose(context, 3, 0.0, None).tokens.tolist() == expected


def test_hybrid_strict_equals_plain(target):
    prompt = torch.tensor([3, 9, 27, 81, 3, 9, 27, 11, 3, 9], dtype=torch.long)
    hybrid = HybridDrafter(ModelDrafter(tiny_lm(1), target.vocab_size), NgramDrafter(3, 2))
    spec, _, _ = run(target, hybrid, prompt, rule=Rule("strict"), k=4, max_new_tokens=30)
    assert spec == reference_greedy(target, prompt, 30)


def test_int8_draft_is_quantised_and_keeps_strict_equal_to_plain(target, prompt):
    draft = tiny_lm(0, "int8-copy-of-target")
    quantize_int8(draft.model)
    assert not any(type(m) is torch.nn.Linear for m in draft.model.modules())
    spec, _, stats = run(
        target, ModelDrafter(draft, target.vocab_size), prompt, rule=Rule("strict"), k=4, max_new_tokens=30
    )
    assert spec == reference_greedy(target, prompt, 30)
    # The draft is the target's own weights in int8: it should agree almost always.
    assert stats.accepted_exact >= 0.8 * stats.drafted


def test_int8_needs_fp32():
    lm = tiny_lm(0)
    lm.model.to(torch.bfloat16)
    with pytest.raises(MarspecError, match="fp32"):
        quantize_int8(lm.model)


def test_adaptive_k_follows_its_schedule_and_keeps_strict_equal_to_plain(target, prompt):
    drafter = ModelDrafter(soft_lm(1), target.vocab_size)
    spec, _, stats = run(
        target, drafter, prompt, rule=Rule("strict"), k=6, adaptive_k=True, max_new_tokens=60
    )
    assert spec == reference_greedy(target, prompt, 60)
    steps = stats.steps
    assert steps[0].drafted == 6
    for before, after in itertools.pairwise(steps[:-1]):  # the last step may be cut by the budget
        accepted_all = before.accepted_exact + before.accepted_relaxed == before.drafted
        expected = min(6, before.drafted + 2) if accepted_all else max(1, before.drafted - 1)
        assert after.drafted == expected
    assert min(s.drafted for s in steps) < 6  # an unrelated draft gets rejected: the length came down


def test_adaptive_k_must_be_a_bool():
    with pytest.raises(MarspecError, match="adaptive_k"):
        DecodeConfig(rule=Rule(), k=4, max_new_tokens=8, adaptive_k="yes")
