"""Log probabilities of the generated tokens (the ``logprobs`` option): each equals the target's own
distribution at temperature 1 where the token was emitted, whatever the rule, regime or draft shape,
read from the verification forward, in one extra host copy per step and none when not asked for."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_lm
from test_decode import RunnerUpDrafter, reference_greedy
from test_tree import WrongChainRightSibling
from test_verify import OnDevice

from marspec.api import GenerationOptions, TokenLogprob
from marspec.decode import DecodeConfig, Step, decode
from marspec.drafters import ModelDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule
from marspec.stats import GenerationStats

TOP = 5
MARS_EVERYWHERE = Rule("mars", theta=0.0, margin="prob_ratio")  # every position is a close call


def noisy_drafter(target) -> ModelDrafter:
    """A draft that is the target plus a little noise: it drafts right often and wrong sometimes."""
    from marspec.backends.hf import HFCausalLM
    from marspec.selftest.tiny import noisy_copy

    draft = HFCausalLM(noisy_copy(target.model, seed=1, scale=0.002), tokenizer=None, name="noisy")
    return ModelDrafter(draft, target_vocab_size=target.vocab_size)


def steps(target, drafter, prompt, **config) -> list[Step]:
    config = DecodeConfig(**{"rule": Rule(), "k": 4, "max_new_tokens": 30, "logprobs": TOP, **config})
    return list(decode(target, drafter, prompt, config, GenerationStats(), torch.Generator().manual_seed(3)))


def reference(target, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """log_softmax of one plain fp32 forward over prompt + output: row i is output token i's distribution."""
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([prompt.tolist() + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], dim=-1)


def check(target, prompt, decoded: list[Step]) -> list[int]:
    """Every step's log probabilities against the reference forward; returns the tokens."""
    tokens = [t for s in decoded for t in s.tokens]
    logprobs = [x for s in decoded for x in s.logprobs]
    tops = [x for s in decoded for x in s.top_logprobs]
    assert len(tokens) == len(logprobs) == len(tops) > 0
    expected = reference(target, prompt, tokens)
    for i, token in enumerate(tokens):
        assert logprobs[i] == pytest.approx(float(expected[i, token]), abs=1e-5)
        ids = [t for t, _ in tops[i]]
        values = [v for _, v in tops[i]]
        assert len(ids) == TOP and values == sorted(values, reverse=True)
        assert ids[0] == int(expected[i].argmax())
        assert values == pytest.approx(expected[i, ids].tolist(), abs=1e-5)
    return tokens


def test_plain_decoding(target, prompt):
    tokens = check(target, prompt, steps(target, None, prompt, k=1))
    assert tokens == reference_greedy(target, prompt, 30)


def test_strict_with_rejections_and_bonus_tokens(target, prompt):
    decoded = steps(target, noisy_drafter(target), prompt, rule=Rule("strict"))
    assert max(len(s.tokens) for s in decoded) > 1  # steps emitted accepted drafts too
    assert any(s.accepted < s.drafted for s in decoded)  # and corrections
    check(target, prompt, decoded)


def test_a_relaxed_mars_token_gets_its_own_lower_logprob(target, prompt):
    drafter = RunnerUpDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    decoded = steps(target, drafter, prompt, rule=MARS_EVERYWHERE, k=3)
    check(target, prompt, decoded)
    relaxed = [(s, i) for s in decoded for i in s.relaxed_at if i < len(s.tokens)]
    assert relaxed
    for step, i in relaxed:
        (best, best_logprob), (second, _) = step.top_logprobs[i][:2]
        assert best == step.relaxed_top1[step.relaxed_at.index(i)] and second == step.tokens[i]
        assert step.logprobs[i] < best_logprob


@pytest.mark.parametrize("rule", [Rule("strict"), MARS_EVERYWHERE])
def test_sampling(target, prompt, rule):
    # At temperature 2 the logprobs are still the target's at temperature 1 (its raw logits).
    decoded = steps(target, noisy_drafter(target), prompt, rule=rule, temperature=2.0)
    assert max(len(s.tokens) for s in decoded) > 1
    check(target, prompt, decoded)


def test_an_eos_cut_keeps_logprobs_aligned_with_the_committed_tokens(target, prompt):
    plain = reference_greedy(target, prompt, 30)
    eos = plain[11]
    drafter = ModelDrafter(tiny_lm(0, "same-weights"), target_vocab_size=target.vocab_size)
    decoded = steps(target, drafter, prompt, rule=Rule("strict"), k=5, eos_token_ids=frozenset({eos}))
    assert decoded[-1].finished
    tokens = check(target, prompt, decoded)
    assert tokens == plain[: plain.index(eos)]


@pytest.mark.parametrize("shape", [(2,), (3, 2)])
def test_a_tree_reads_the_rows_of_its_accepted_path(target, prompt, shape):
    plain = reference_greedy(target, prompt, 30)
    oracle = WrongChainRightSibling(len(prompt), plain + [0] * 8)  # siblings accepted nearly every step
    decoded = steps(target, oracle, prompt, rule=Rule("strict"), k=3, tree=shape)
    assert check(target, prompt, decoded) == plain
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    check(target, prompt, steps(target, drafter, prompt, rule=MARS_EVERYWHERE, k=3, tree=shape))


def test_no_alternatives_asked_lists_none(target, prompt):
    decoded = steps(target, None, prompt, k=1, logprobs=0, max_new_tokens=5)
    assert all(len(s.logprobs) == 1 and s.top_logprobs == ((),) for s in decoded)


def test_not_asked_the_loop_reads_nothing_more(target, prompt, monkeypatch):
    """Off: a step reads the device once (test_decode's count) and returns no log probabilities; on:
    one more copy per step, whatever the step emitted."""
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **kw: forward(*a, **kw).as_subclass(OnDevice))
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    for logprobs, reads_per_step in ((None, 1), (TOP, 2)):
        OnDevice.reads.clear()
        decoded = steps(target, drafter, prompt, rule=MARS_EVERYWHERE, logprobs=logprobs)
        assert OnDevice.reads == ["cpu"] * reads_per_step * len(decoded)
        assert all(bool(s.logprobs) == (logprobs is not None) for s in decoded)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "5"])
def test_option_validation_is_one_line(value):
    with pytest.raises(MarspecError, match=r"logprobs must be None \(off\) or .* in \[0, 20\]") as err:
        GenerationOptions(logprobs=value)
    assert "\n" not in str(err.value) and err.value.field == "logprobs"


def test_a_generation_result_aligns_logprobs_with_its_tokens(tmp_path):
    from marspec.selftest.tiny import tiny_decoder

    decoder = tiny_decoder(tmp_path, torch.device("cpu"))
    result = decoder.generate("Hello", rule="mars", theta=0.0, max_new_tokens=12, logprobs=2)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    assert [t.token_id for t in result.logprobs] == result.token_ids
    assert all(isinstance(t, TokenLogprob) and len(t.top) == 2 for t in result.logprobs)
    assert result.to_dict()["logprobs"][0]["token_id"] == result.token_ids[0]
    stream = decoder.stream("Hello", max_new_tokens=12, logprobs=0)
    text = "".join(stream)
    assert stream.result is not None and stream.result.logprobs == stream.logprobs
    assert text == stream.result.text and len(stream.logprobs) == 12
    assert decoder.generate("Hello", max_new_tokens=4).logprobs is None
