"""The decode loop on tiny random models: cache discipline, invariants, limits, drafters."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_lm

from marspec.decode import DecodeConfig, decode
from marspec.drafters import Draft, ModelDrafter, NgramDrafter
from marspec.rules import Rule
from marspec.stats import GenerationStats


def reference_greedy(lm, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding with no cache at all: the full sequence is re-scored for every token."""
    seq = prompt.tolist()
    for _ in range(n):
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([seq])).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(prompt) :]


def run(target, drafter, prompt, draft_cap=None, **kw):
    stats = GenerationStats()
    config = DecodeConfig(**{"rule": Rule(), "k": 1, **kw})  # plain decoding reads neither
    tokens, relaxed = [], []
    generator = torch.Generator().manual_seed(0)
    for step in decode(target, drafter, prompt, config, stats, generator, draft_cap):
        tokens += step.tokens
        relaxed += [i in step.relaxed_at for i in range(len(step.tokens))]
    return tokens, relaxed, stats


def test_plain_matches_uncached_greedy(target, prompt):
    tokens, _, stats = run(target, None, prompt, max_new_tokens=24)
    assert tokens == reference_greedy(target, prompt, 24)
    assert stats.target_forwards == 24 and stats.tau == 1.0
    assert target.cached_len == len(prompt) + 24 - 1  # the newest token is pending, never cached


def test_strict_with_unrelated_draft_equals_plain(target, prompt):
    plain, _, _ = run(target, None, prompt, max_new_tokens=30)
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    spec, relaxed, stats = run(target, drafter, prompt, rule=Rule("strict"), k=4, max_new_tokens=30)
    assert spec == plain
    assert not any(relaxed)
    assert stats.rejected > 0  # a random drafter is mostly wrong: the rejection path ran


def test_self_draft_accepts_everything_and_uses_bonus(target, prompt):
    plain, _, _ = run(target, None, prompt, max_new_tokens=31)
    drafter = ModelDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    spec, _, stats = run(target, drafter, prompt, rule=Rule("strict"), k=5, max_new_tokens=31)
    assert spec == plain
    assert stats.rejected == 0
    assert stats.tau > 5.0  # 6 tokens per forward except where the budget cut the draft
    assert stats.accepted_by_position()[0] == 1.0


def test_a_draft_cap_read_at_each_step_bounds_its_draft_and_leaves_a_greedy_lossless_answer(target, prompt):
    plain, _, _ = run(target, None, prompt, max_new_tokens=31)
    drafter = ModelDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    caps = iter([5, 0, 2, 0, 1] * 20)  # the batch beside it growing and shrinking
    seen: list[int] = []

    def cap() -> int:
        seen.append(next(caps))
        return seen[-1]

    spec, _, stats = run(target, drafter, prompt, cap, rule=Rule("strict"), k=5, max_new_tokens=31)
    assert spec == plain
    bounds = [min(c, 31 - 1 - done) for c, done in zip(seen, _done(stats), strict=True)]
    assert [s.drafted for s in stats.steps] == bounds
    assert DecodeConfig(rule=Rule("strict"), k=5, max_new_tokens=1).drafts_leave_output
    mars = Rule("mars", theta=0.5, margin="logit_ratio")
    assert not DecodeConfig(rule=mars, k=5, max_new_tokens=1).drafts_leave_output
    assert not DecodeConfig(rule=Rule("strict"), k=5, max_new_tokens=1, temperature=1.0).drafts_leave_output


def _done(stats: GenerationStats) -> list[int]:
    """Tokens produced before each step."""
    done, total = [], 0
    for step in stats.steps:
        done.append(total)
        total += step.emitted
    return done


def test_drafts_after_an_accepted_eos_are_not_counted_as_accepted(target, prompt):
    """The text ends at an EOS inside an accepted draft: the drafts after it were scored but never judged,
    so neither the accepted counts nor the acceptance rate include them."""
    plain, _, _ = run(target, None, prompt, max_new_tokens=8)
    eos = plain[2]
    assert eos not in plain[:2]  # the tiny model's greedy text; the test needs its first EOS at index 2
    drafter = ModelDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    spec, _, stats = run(
        target, drafter, prompt, rule=Rule("strict"), k=5, max_new_tokens=8, eos_token_ids=frozenset({eos})
    )
    assert spec == plain[:2] and stats.stopped_at_eos
    assert (stats.drafted, stats.unjudged, stats.accepted_exact, stats.rejected) == (5, 2, 3, 0)
    assert stats.acceptance_rate == 1.0
    assert stats.position_counts() == ([1, 1, 1], [1, 1, 1])
    assert len(stats.steps[0].margins) == 3  # the margins of judged positions only


def test_mars_theta_one_equals_strict(target, prompt):
    drafter = ModelDrafter(tiny_lm(2, "tiny-draft"), target_vocab_size=target.vocab_size)
    strict, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=3, max_new_tokens=30)
    mars1, relaxed, _ = run(
        target, drafter, prompt, rule=Rule("mars", 1.0, "logit_ratio"), k=3, max_new_tokens=30
    )
    assert mars1 == strict and not any(relaxed)


class RunnerUpDrafter(ModelDrafter):
    """Proposes the draft model's second choice at every position: with the target's own weights that is
    exactly the target's runner-up, the token MARS may relax to."""

    def propose(self, context, k, temperature, generator, alternatives=0):
        logits = self.draft_model.forward(context[self.draft_model.cached_len :], last_only=True)[-1]
        tokens = torch.empty(k, dtype=torch.long)
        for i in range(k):
            tokens[i] = torch.topk(logits, 2).indices[1]
            if i + 1 < k:
                logits = self.draft_model.forward(tokens[i : i + 1])[-1]
        return Draft(tokens=tokens)


def test_mars_differs_from_strict_first_at_a_relaxed_position(target, prompt):
    drafter = RunnerUpDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    strict, _, strict_stats = run(target, drafter, prompt, rule=Rule("strict"), k=3, max_new_tokens=40)
    assert strict_stats.accepted_exact + strict_stats.accepted_relaxed == 0  # runner-ups never match
    # theta = 0 with the probability ratio calls every position a close call: every draft is relaxed.
    mars, relaxed, stats = run(
        target, drafter, prompt, rule=Rule("mars", theta=0.0, margin="prob_ratio"), k=3, max_new_tokens=40
    )
    assert stats.accepted_relaxed > 0 and stats.accepted_exact == 0
    assert stats.tau > strict_stats.tau
    first_diff = next(i for i, (a, b) in enumerate(zip(strict, mars, strict=True)) if a != b)
    assert relaxed[first_diff]
    assert sum(relaxed) == stats.accepted_relaxed


def test_each_relaxed_token_reports_the_top_choice_it_replaced(target, prompt):
    """The target's top-1 and the margin at every relaxed token: what an audit of the output shows."""
    drafter = RunnerUpDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    rule = Rule("mars", theta=0.0, margin="prob_ratio")
    config = DecodeConfig(rule=rule, k=3, max_new_tokens=25)
    seq = prompt.tolist()
    for step in decode(target, drafter, prompt, config, GenerationStats()):
        assert len(step.relaxed_top1) == len(step.relaxed_margins) == len(step.relaxed_at)
        replaced = iter(zip(step.relaxed_top1, step.relaxed_margins, strict=True))
        for position, token in enumerate(step.tokens):
            if position in step.relaxed_at:
                top1, margin = next(replaced)
                with torch.no_grad():
                    logits = target.model(input_ids=torch.tensor([seq])).logits[0, -1]
                best, second = torch.topk(logits, 2).values.tolist()
                assert top1 == int(torch.argmax(logits)) != token
                assert margin == pytest.approx(math.exp(second - best), rel=1e-4)  # p2/p1
            seq.append(token)


def test_ngram_drafter_strict_equals_plain(target):
    prompt = torch.tensor([3, 9, 27, 81, 3, 9, 27, 81, 3, 9], dtype=torch.long)
    plain, _, _ = run(target, None, prompt, max_new_tokens=20)
    spec, _, _ = run(target, NgramDrafter(), prompt, rule=Rule("strict"), k=4, max_new_tokens=20)
    assert spec == plain


def test_eos_stops_and_is_not_emitted(target, prompt):
    plain, _, _ = run(target, None, prompt, max_new_tokens=20)
    eos = plain[6]
    cut = plain.index(eos)
    drafter = ModelDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    tokens, _, _ = run(
        target, drafter, prompt, rule=Rule("strict"), k=5, max_new_tokens=20, eos_token_ids=frozenset({eos})
    )
    assert tokens == plain[:cut]
    plain_until_eos, _, stats = run(target, None, prompt, max_new_tokens=20, eos_token_ids=frozenset({eos}))
    assert plain_until_eos == plain[:cut]
    assert stats.stopped_at_eos and stats.tau == 1.0  # the EOS counts as generated


def test_max_new_tokens_is_exact_with_long_drafts(target, prompt):
    drafter = ModelDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    for n in (1, 2, 7, 13):
        tokens, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=5, max_new_tokens=n)
        assert len(tokens) == n


def test_sampling_is_reproducible_with_a_seed(target, prompt):
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    a, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=3, temperature=0.8, max_new_tokens=20)
    b, _, _ = run(target, drafter, prompt, rule=Rule("strict"), k=3, temperature=0.8, max_new_tokens=20)
    assert a == b and len(a) == 20


def test_ngram_proposes_continuation_of_latest_match():
    context = torch.tensor([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3])
    draft = NgramDrafter(max_ngram=3).propose(context, 2, 0.0, None)
    assert draft.tokens.tolist() == [5, 6]
    assert len(NgramDrafter().propose(torch.tensor([7, 8, 9]), 3, 0.0, None)) == 0


def test_a_step_reads_the_device_once(target, prompt, monkeypatch):
    """Everything the loop needs of a verification step arrives in one device-to-host copy: the target's
    logits stand for an accelerator's (test_verify.OnDevice logs each host read). On a GPU each read is a
    sync; the draft's confidence stop, off here, adds one per drafted token."""
    from test_verify import OnDevice

    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **kw: forward(*a, **kw).as_subclass(OnDevice))
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    for rule in (Rule("strict"), Rule("mars", 0.0, "prob_ratio")):
        OnDevice.reads.clear()
        tokens, _, stats = run(target, drafter, prompt, rule=rule, k=4, max_new_tokens=30)
        assert OnDevice.reads == ["cpu"] * stats.target_forwards, rule
        assert len(tokens) == 30
