"""The plugin's decision on vLLM's own rejection sampler equals marspec's rule on the same logits.

Random ragged batches (0-5 draft tokens per request) mixing greedy and sampled requests go through
vLLM's ``rejection_sample`` (CPU kernels, with the plugin active); each request's block goes through
``verify_greedy`` or ``verify_sampling``. Sampled rows are built so that every decision is certain (the
draft token holds nearly all the target's mass, or next to none, or is a close call that MARS accepts
without a draw): then the two implementations, with different random numbers, must still agree token
for token.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

from blocks import REQUEST_RULES, Block, random_block
from vllm.v1.sample import rejection_sampler

from marspec.integrations.vllm import cpu_expand, plugin, request_rules
from marspec.integrations.vllm.config import PluginConfig
from marspec.integrations.vllm.offline import install_cpu_overrides, sampling_metadata
from marspec.rules import Rule
from marspec.verify import verify_greedy, verify_sampling

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


def test_vllm_kernels_give_each_request_its_own_rule_in_one_batch() -> None:
    """Per-request rules (``extra_args["marspec"]``, recorded per batch by the runner's hook): each
    request of a batch mixing the deployment's MARS, strict, a relaxing MARS, pthresh and FLy gets the
    tokens its own rule gives it alone; the counters are kept per rule name."""
    check_plugin_equals_rule(
        Rule("mars", 0.9, "logit_ratio"),
        1.0,
        False,
        7,
        sampled_close_calls=False,
        batches=40,
        pool=REQUEST_RULES,
    )


def check_plugin_equals_rule(
    rule: Rule,
    greedy_share: float,
    with_draft_probs: bool,
    seed: int,
    sampled_close_calls: bool,
    sampled_rule: Rule | None = None,
    batches: int = 20,
    pool: list[Rule | None] | None = None,
) -> None:
    """Random batches through vLLM's rejection sampler with the plugin active give marspec's tokens and
    the relaxation counts marspec's rule gives on the same blocks (``sampled_rule``, when given, is the
    rule sampled requests are expected to get instead; ``pool``, when given, the per-request rules each
    request picks one of, None for the deployment's ``rule``)."""
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
        asked = [pool[int(torch.randint(len(pool), (), generator=g))] for _ in blocks] if pool else [None] * n
        own = [a or rule for a in asked]
        plugin.counters.reset()
        request_rules._batch = asked if pool else None
        try:
            ours = vllm_verify(blocks, with_draft_probs)
        finally:
            request_rules._batch = None
        expected = [
            marspec_verify(b, r if b.greedy else sampled_rule or r, with_draft_probs, g)
            for b, r in zip(blocks, own, strict=True)
        ]
        assert ours == [tokens for tokens, _ in expected], f"counts {counts}, greedy {greedy}, rules {own}"
        snapshot = plugin.counters.snapshot()
        relaxed = sum(n_relaxed for _, n_relaxed in expected)
        accepted = sum(len(tokens) - 1 for tokens, _ in expected)
        assert snapshot["accepted_relaxed"] == relaxed
        assert snapshot["accepted_exact"] + snapshot["accepted_relaxed"] == accepted
        for name, totals in plugin.counters.by_rule().items():
            mine = [(e, b) for e, b, r in zip(expected, blocks, own, strict=True) if r.name == name]
            assert totals["accepted_relaxed"] == sum(n_relaxed for (_, n_relaxed), _ in mine), name
            assert totals["drafted"] == sum(len(b.drafts) for _, b in mine), name
        relaxed_total += relaxed
    if any(r.relaxes for r in [rule, *(p for p in pool or [] if p)]):
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
    assert cpu_expand.fix_cpu_expand_kernel(), "the plugin did not replace the broken override"
    assert expand() == expected
    assert not cpu_expand.fix_cpu_expand_kernel(), "a working expand must be left alone"


class SelfDict:
    """An attribute whose ``__dict__`` is not a dict, like a C library's function wrapper that a
    ``vllm serve`` worker has loaded: vLLM's ``register_kernels`` scan stops at it."""

    @property
    def __dict__(self) -> object:  # type: ignore[override]
        return self


def test_the_expand_fix_survives_a_module_vllms_kernel_registry_cannot_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # v0.28 has no kernel registry (its CPU runner assigns the module attribute): nothing to survive.
    dispatcher = pytest.importorskip("vllm.triton_utils.dispatcher")
    install_cpu_overrides()  # vLLM's own (broken) CPU expand again, while its registry still works
    holder = types.ModuleType("marspec_test_unscannable")
    holder.wrapper = SelfDict()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    with pytest.raises(AttributeError):  # vLLM's registry now fails in this process, as in vllm serve's
        dispatcher.register_kernels({})
    assert cpu_expand.fix_cpu_expand_kernel(), "the plugin did not replace the broken override"
    assert rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.0, 2.5]), torch.tensor([1, 3]).int(), 3, replace_from=0, replace_to=1
    ).tolist() == [1.0, 2.5, 2.5]
