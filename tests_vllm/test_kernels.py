"""The plugin's decision on vLLM's own rejection sampler equals marspec's rule on the same logits.

Random ragged batches (0-5 draft tokens per request) mixing greedy and sampled requests go through
vLLM's ``rejection_sample`` (CPU kernels, with the plugin active); each request's block goes through
``verify_greedy`` or ``verify_sampling``. Sampled rows are built so that every decision is certain (the
draft token holds nearly all the target's mass, or next to none, or is a close call that MARS accepts
without a draw): then the two implementations, with different random numbers, must still agree token
for token.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from blocks import Block, random_block
from vllm.v1.sample import rejection_sampler

from marspec.integrations.vllm import plugin
from marspec.integrations.vllm.config import PluginConfig
from marspec.integrations.vllm.offline import install_cpu_overrides, sampling_metadata
from marspec.verify import Rule, verify_greedy, verify_sampling

VOCAB = 64
SAMPLED_TEMPERATURE = 1.0  # rejection_sample receives logits already divided by the temperature


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels() -> None:
    install_cpu_overrides()  # no Triton here: vLLM's CPU stand-ins for its kernels


def vllm_verify(blocks: list[Block], with_draft_probs: bool) -> list[list[int]]:
    """Every block at once through vLLM's rejection sampler (the plugin's wrapper around it)."""
    counts = [len(b.drafts) for b in blocks]
    output = rejection_sampler.rejection_sample(
        torch.cat([b.drafts for b in blocks]).int(),  # [T]
        counts,
        max(counts),
        torch.tensor(counts).cumsum(0).int(),  # [B]
        torch.cat([b.draft_probs for b in blocks]) if with_draft_probs else None,  # [T, V]
        torch.cat([b.logits[:-1] for b in blocks]),  # [T, V]
        torch.stack([b.logits[-1].argmax() for b in blocks])[:, None].int(),  # [B, 1]: the bonus tokens
        sampling_metadata(torch.tensor([0.0 if b.greedy else SAMPLED_TEMPERATURE for b in blocks])),
    )  # [B, max(counts) + 1]
    return [[t for t in row if t != -1] for row in output.tolist()]


def marspec_verify(
    block: Block, rule: Rule, with_draft_probs: bool, g: torch.Generator
) -> tuple[list[int], int]:
    if block.greedy:
        result = verify_greedy(block.logits, block.drafts, rule)
    else:
        probs = block.draft_probs if with_draft_probs else None
        result = verify_sampling(block.logits, block.drafts, probs, rule, SAMPLED_TEMPERATURE, g)
    return result.emitted(), result.n_relaxed


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["ngram", "draft-model"])
@pytest.mark.parametrize("theta", [0.9, 1.0])
@pytest.mark.parametrize("greedy_share", [0.0, 0.5, 1.0], ids=["all-sampled", "mixed", "all-greedy"])
def test_vllm_kernels_with_plugin_equal_marspec_rule(
    theta: float, greedy_share: float, with_draft_probs: bool
) -> None:
    rule = Rule("mars", theta, "logit_ratio")
    seed = int(theta * 100 + greedy_share * 10 + with_draft_probs)
    check_plugin_equals_rule(rule, greedy_share, with_draft_probs, seed, sampled_close_calls=rule.relaxes)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["ngram", "draft-model"])
@pytest.mark.parametrize("greedy_share", [0.5, 1.0], ids=["mixed", "all-greedy"])
@pytest.mark.parametrize(("name", "parameter"), [("typical", 0.2), ("pthresh", 0.25), ("topk", 2)])
def test_vllm_kernels_with_plugin_equal_each_rival_rule(
    name: str, parameter: float, greedy_share: float, with_draft_probs: bool
) -> None:
    """The rivals fit the plugin's forcing scheme too. Sampled rows carry no close call here: where a
    rival does not accept one, the correction would be a draw of vLLM's own generator against ours."""
    rule = Rule(name, parameter)
    seed = len(name) * 100 + int(greedy_share * 10) + with_draft_probs
    check_plugin_equals_rule(rule, greedy_share, with_draft_probs, seed, sampled_close_calls=False)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["ngram", "draft-model"])
@pytest.mark.parametrize("greedy_share", [0.5, 1.0], ids=["mixed", "all-greedy"])
@pytest.mark.parametrize(
    "rule", [Rule("fly", 0.3, window=1), Rule("fly", 0.3, window=2), Rule("fly", 2.0, window=6)]
)
def test_vllm_kernels_with_plugin_equal_fly_for_greedy_and_strict_for_sampled(
    rule: Rule, greedy_share: float, with_draft_probs: bool
) -> None:
    """FLy on the flattened batch: a greedy request's deferrals read its own following rows only (a
    close call's top-3 entropy in these blocks is ~0.58 nats, a clear one's ~0); sampled requests are
    verified strictly (lossless), as the plugin says it does under FLy. A deferral needs a close
    mismatch and ``window`` top-1 drafts after it in one request: more batches than for a row rule."""
    seed = int(rule.theta * 10) + 10 * (rule.window or 0) + int(greedy_share * 100) + with_draft_probs
    check_plugin_equals_rule(
        rule,
        greedy_share,
        with_draft_probs,
        seed,
        sampled_close_calls=False,
        sampled_rule=Rule("strict"),
        batches=60,
    )


def check_plugin_equals_rule(
    rule: Rule,
    greedy_share: float,
    with_draft_probs: bool,
    seed: int,
    sampled_close_calls: bool,
    sampled_rule: Rule | None = None,
    batches: int = 20,
) -> None:
    """Random batches through vLLM's rejection sampler with the plugin active give marspec's tokens and
    the relaxation counts marspec's rule gives on the same blocks (``sampled_rule``, when given, is the
    rule sampled requests are expected to get instead)."""
    plugin.activate(PluginConfig(rule, log_every=0))
    g = torch.Generator().manual_seed(seed)
    relaxed_total = 0
    for _ in range(batches):
        n = int(torch.randint(1, 7, (), generator=g))
        greedy = (torch.rand(n, generator=g) < greedy_share).tolist()
        counts = torch.randint(0, 6, (n,), generator=g).tolist()
        blocks = [
            random_block(g, k, VOCAB, gr, sampled_close_calls) for k, gr in zip(counts, greedy, strict=True)
        ]
        plugin.counters.reset()
        ours = vllm_verify(blocks, with_draft_probs)
        expected = [
            marspec_verify(b, rule if b.greedy else sampled_rule or rule, with_draft_probs, g) for b in blocks
        ]
        assert ours == [tokens for tokens, _ in expected], f"counts {counts}, greedy {greedy}"
        snapshot = plugin.counters.snapshot()
        relaxed = sum(n_relaxed for _, n_relaxed in expected)
        accepted = sum(len(tokens) - 1 for tokens, _ in expected)
        assert snapshot["accepted_relaxed"] == relaxed
        assert snapshot["accepted_exact"] + snapshot["accepted_relaxed"] == accepted
        relaxed_total += relaxed
    if rule.relaxes:
        assert relaxed_total > 0, f"no close call was accepted: the test did not exercise {rule.name}"


def test_mixed_batch_temperatures_reach_every_draft_token_on_cpu() -> None:
    """vLLM issue 55005: its CPU expand override left the per-token temperatures of a mixed batch
    uninitialised, so even greedy rows were divided by garbage; the plugin's replacement must not."""

    def expand() -> list[float]:
        temperatures = torch.tensor([0.0, 0.7, 0.0, 1.3])  # [B]: 0 is greedy
        counts = torch.tensor([2, 0, 3, 1])  # [B]
        expanded = rejection_sampler.expand_batch_to_tokens(
            temperatures, counts.cumsum(0).int(), int(counts.sum()), replace_from=0, replace_to=1
        )  # [T]
        return expanded.tolist()

    install_cpu_overrides()  # vLLM's own again: an earlier test's first verification replaced it
    expected = pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 1.3])
    assert expand() != expected, "vLLM's override works here: the fix would not be needed"
    assert plugin.fix_cpu_expand_kernel(), "the plugin did not replace the broken override"
    assert expand() == expected
    assert not plugin.fix_cpu_expand_kernel(), "a working expand must be left alone"
