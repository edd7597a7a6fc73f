"""Block verification (rule="block", Sun et al. 2024, arXiv 2403.10444): every branch on hand-made
probabilities, its exact output distribution against the target's by enumeration, and greedy == strict
through the loop. The chi-square through whole sampled decodes is in tests/test_sampling_lossless.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_lm

from marspec.decode import DecodeConfig, decode
from marspec.drafters import ModelDrafter
from marspec.errors import MarspecError
from marspec.rules import Rule
from marspec.stats import GenerationStats
from marspec.verify.block import block_acceptance, verify_block
from marspec.verify.sampling import verify_sampling

BLOCK = Rule("block")


def logits_of(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is each row (given as probabilities)."""
    return torch.tensor(rows, dtype=torch.float64).log().float()  # a 0 is -inf: never drawn


def probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def tok(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def seeds(n: int):
    return (torch.Generator().manual_seed(s) for s in range(n))


@pytest.mark.parametrize("min_confidence", [0.0, 0.8])
def test_the_block_is_lossless_exactly(min_confidence: float) -> None:
    """Enumerate every draft of a 3-token vocabulary and length up to 3 (q context-dependent), the
    probability of each accepted count (eta_i < h_i independently, the largest passing i) and of each
    next token; extend by the target to 4 tokens. The result is the target's joint distribution, to
    float32's rounding. With ``min_confidence`` the draft ends after a token drafted where q's top
    probability is below it (ModelDrafter's confidence stop), so its length depends on the draft: the
    block stays lossless. At a fixed length, the expected accepted count beats token-by-token
    speculative sampling's."""
    vocab, k = 3, 3
    torch.manual_seed(0)
    tables: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def dist(kind: str, prefix: tuple[int, ...]) -> torch.Tensor:
        if (kind, prefix) not in tables:
            sharp = 1.5 if kind == "p" else 2.5
            tables[kind, prefix] = torch.softmax(torch.randn(vocab, dtype=torch.float64) * sharp, -1)
        return tables[kind, prefix]

    def target_prob(seq: tuple[int, ...], start: int) -> float:
        out = 1.0
        for i in range(start, len(seq)):
            out *= float(dist("p", seq[:i])[seq[i]])
        return out

    def drafts(prefix: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every draft the drafter can make after ``prefix``, ending at length k or at the stop."""
        if len(prefix) == k or (prefix and float(dist("q", prefix[:-1]).max()) < min_confidence):
            return [prefix]
        return [d for x in range(vocab) for d in drafts((*prefix, x))]

    joint = {seq: 0.0 for seq in itertools.product(range(vocab), repeat=k + 1)}
    block_accepts = token_accepts = 0.0
    lengths = set()
    for draft in drafts(()):
        m = len(draft)
        lengths.add(m)
        q_draft = 1.0
        for i in range(m):
            q_draft *= float(dist("q", draft[:i])[draft[i]])
        p = torch.stack([dist("p", draft[:i]) for i in range(m + 1)]).float()
        q = torch.stack([dist("q", draft[:i]) for i in range(m)]).float()
        stop, weight = block_acceptance(p, tok(*draft), q)
        for n in range(m + 1):
            chance = float(stop[n - 1]) if n else 1.0
            for j in range(n + 1, m + 1):
                chance *= 1.0 - float(stop[j - 1])
            block_accepts += q_draft * chance * n
            if chance == 0.0:
                continue  # never stops here (its residual may be all zero)
            if n == m:
                residual = p[m].double()
            else:
                residual = (float(weight[n]) * p[n].double() - q[n].double()).clamp(min=0)
            residual = residual / residual.sum()
            for y in range(vocab):
                head = (*draft[:n], y)
                for tail in itertools.product(range(vocab), repeat=k - n):
                    seq = head + tail
                    joint[seq] += q_draft * chance * float(residual[y]) * target_prob(seq, len(head))
        passed = 1.0
        for i in range(m):
            passed *= min(1.0, float(dist("p", draft[:i])[draft[i]] / dist("q", draft[:i])[draft[i]]))
            token_accepts += q_draft * passed
    worst = max(abs(joint[seq] - target_prob(seq, 0)) for seq in joint)
    assert worst < 1e-6
    if min_confidence:
        assert len(lengths) > 1  # the stop ends some drafts early: the length depends on the draft
    else:
        assert block_accepts > token_accepts + 0.01  # 0.108 against 0.090 accepted drafts per block


def test_a_later_surplus_pays_for_an_earlier_shortfall() -> None:
    """p/q = 0.5 at the first draft and 2 at the second: token by token the first is rejected about
    half the time; the block owes the target nothing after both (w_2 = min(1, 0.5 * 2) = 1), so it
    accepts both every time."""
    logits = logits_of([0.25, 0.75, 0.0], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5])
    q = probs([0.5, 0.5, 0.0], [0.4, 0.3, 0.3])
    draft = tok(0, 1)
    stop, weight = block_acceptance(torch.softmax(logits, -1), draft, q)
    torch.testing.assert_close(weight, torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64))
    assert float(stop[1]) == 1.0
    block = [verify_block(logits, draft, q, 1.0, g, BLOCK).n_accepted for g in seeds(40)]
    tokenwise = [verify_sampling(logits, draft, q, BLOCK, 1.0, g).n_accepted for g in seeds(40)]
    assert block == [2] * 40  # verify_sampling hands rule="block" on to verify_block
    strict = [verify_sampling(logits, draft, q, Rule(), 1.0, g).n_accepted for g in seeds(40)]
    assert tokenwise == block and 5 < strict.count(0) < 35


def test_a_draft_the_target_cannot_produce_stops_the_block_before_it() -> None:
    logits = logits_of([0.0, 0.5, 0.5], [0.1, 0.6, 0.3], [0.2, 0.3, 0.5])
    q = probs([0.6, 0.2, 0.2], [0.1, 0.6, 0.3])
    stop, weight = block_acceptance(torch.softmax(logits, -1), tok(0, 1), q)
    assert weight.tolist()[1:] == [0.0, 0.0] and stop.tolist() == [0.0, 0.0]
    for g in seeds(30):
        result = verify_block(logits, tok(0, 1), q, 1.0, g, BLOCK)
        assert result.n_accepted == 0 and result.next_token in (1, 2)  # residual max(0, p - q) > 0 there


def test_the_last_draft_is_accepted_with_the_weight_the_block_still_has() -> None:
    """After a shortfall (w_1 = 0.5) that the next draft does not repay (p = q there), h_2 = w_2 = 0.5
    and h_1 = 0 (the residual at row 1 is max(0, 0.5 p - p) = 0): the block takes both or none."""
    logits = logits_of([0.25, 0.75, 0.0], [0.2, 0.5, 0.3], [0.2, 0.3, 0.5])
    q = probs([0.5, 0.5, 0.0], [0.2, 0.5, 0.3])
    stop, _ = block_acceptance(torch.softmax(logits, -1), tok(0, 1), q)
    torch.testing.assert_close(stop, torch.tensor([0.0, 0.5], dtype=torch.float64), atol=1e-6, rtol=0)
    counts = [verify_block(logits, tok(0, 1), q, 1.0, g, BLOCK).n_accepted for g in seeds(200)]
    assert set(counts) == {0, 2} and 70 < counts.count(2) < 130


def test_a_deterministic_draft_is_one_hot_q() -> None:
    """q None (a lookup drafter): p(d_1) = 0.5, and the target is sure of d_2; the block takes both or
    none, and a rejection's token is never the rejected draft (the one-hot residual)."""
    logits = logits_of([0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5])
    stop, weight = block_acceptance(torch.softmax(logits, -1), tok(0, 1), None)
    torch.testing.assert_close(weight, torch.tensor([1.0, 0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(stop, torch.tensor([0.0, 0.5], dtype=torch.float64), atol=1e-6, rtol=0)
    results = [verify_block(logits, tok(0, 1), None, 1.0, g, BLOCK) for g in seeds(200)]
    assert {r.n_accepted for r in results} == {0, 2}
    assert all(r.next_token != 0 for r in results if r.n_accepted == 0)


def test_an_empty_draft_samples_the_target_and_nothing_is_relaxed() -> None:
    logits = logits_of([0.0, 0.0, 1.0])
    result = verify_block(logits, tok(), None, 0.7, torch.Generator().manual_seed(0), BLOCK)
    assert (result.n_accepted, result.next_token, result.n_relaxed) == (0, 2, 0)
    full = verify_block(logits_of([0.0, 1.0, 0.0], [1.0, 0.0, 0.0]), tok(1), None, 1.0, None, BLOCK)
    assert (full.n_accepted, full.next_token, full.n_relaxed) == (1, 0, 0)  # the bonus from p_K


def test_bad_inputs_are_refused() -> None:
    logits = logits_of([0.5, 0.5, 0.0], [0.2, 0.3, 0.5])
    with pytest.raises(MarspecError, match="temperature=0 is invalid for sampling"):
        verify_block(logits, tok(0), None, 0, None, BLOCK)
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_block(logits, tok(0), probs([1.0, 0.0]), 1.0, None, BLOCK)


def test_block_is_lossless_so_it_takes_no_theta_and_any_guard() -> None:
    assert not Rule("block").relaxes and Rule("block", guard="class") and Rule("block", guard="thinking")
    Rule("block").check_tree()  # trees verify greedily, where block is strict
    with pytest.raises(MarspecError, match="for rule 'block' needs a margin"):
        Rule("block", 0.5)


def test_greedy_block_is_strict_through_the_loop(target, prompt) -> None:
    drafter = ModelDrafter(tiny_lm(2, "tiny-draft"), target_vocab_size=target.vocab_size)

    def tokens(rule: Rule, **kw) -> list[int]:
        config = DecodeConfig(rule=rule, k=3, max_new_tokens=30, **kw)
        return [t for step in decode(target, drafter, prompt, config, GenerationStats()) for t in step.tokens]

    assert tokens(BLOCK) == tokens(Rule()) == tokens(BLOCK, tree=(2, 2))
