"""The plugin on vLLM's V2 verifier (the real ``rejection_sample`` of rejection_sampler_utils.py, its Triton
kernels run by Triton's interpreter on CPU) equals marspec's own rule, request by request.

Batches are laid out as V2's ``RejectionSampler._verify`` hands them over: per request its draft rows
then its bonus row, the token a row verifies in the next row's ``draft_sampled``, requests in a shuffled
order of request-state slots (``idx_mapping``) so that each request's temperature is read from its own
slot, greedy and sampled requests mixed, some drafts ``-1`` placeholders. Sampled rows are built so that
every decision is certain (``tests_vllm/blocks.py``), so vLLM's random numbers and ours need
not agree for the tokens to. Not run: sampled requests with the drafter's full distribution
(``draft_logits``), whose resampling kernel calls libdevice, which the interpreter lacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm")

from blocks import REQUEST_RULES, random_block
from vllm.triton_utils import HAS_TRITON
from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_rejection_sampler

from marspec.integrations.vllm import plugin, request_rules
from marspec.integrations.vllm.config import PluginConfig
from marspec.integrations.vllm.versions import V2_VERIFIER
from marspec.rules import Rule
from marspec.verify import verify_greedy, verify_sampling

VOCAB = 96
STEPS = 5  # num_speculative_steps: a request drafts 0..STEPS tokens


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter() -> None:
    assert HAS_TRITON, "vLLM did not enable Triton: this folder's conftest must run before vLLM is imported"


@dataclass
class Request:
    """One request of a V2 batch: K draft rows plus the bonus row, in processed (tempered) logits."""

    logits: torch.Tensor  # [K+1, V]
    drafts: torch.Tensor  # long[K]; -1 marks a placeholder
    draft_probs: torch.Tensor  # [K, V]: the drafter's distribution q
    temperature: float  # 0 is greedy


def random_request(g: torch.Generator, k: int, temperature: float, relaxes: bool) -> Request:
    block = random_block(g, k, VOCAB, temperature == 0, relaxes)
    if k > 1 and torch.rand((), generator=g) < 0.15:
        block.drafts[int(torch.randint(1, k, (), generator=g))] = -1  # a placeholder (invalid draft)
    return Request(block.logits, block.drafts, block.draft_probs, temperature)


def v2_verify(
    requests: list[Request],
    with_draft_logits: bool,
    g: torch.Generator,
    asked: list[Rule | None] | None = None,
) -> list[list[int]]:
    """The batch through V2's verifier as ``RejectionSampler._verify`` calls it (the module global);
    ``asked``: each request's own rule, recorded per slot as the plugin's ``add_request`` hook does."""
    num_reqs = len(requests)
    slots = torch.randperm(num_reqs + 2, generator=g)[:num_reqs]  # request-state slots, not 0..R-1
    request_rules._slots.clear()
    for slot, rule in zip(slots.tolist(), asked or [], strict=False):
        if rule is not None:
            request_rules._slots[slot] = rule
    max_num_reqs = num_reqs + 2
    temperature = torch.full((max_num_reqs,), 0.9)  # slots no request uses: must not be read
    seed = torch.randint(0, 2**31, (max_num_reqs,), generator=g)
    draft_logits = torch.full((max_num_reqs, STEPS, VOCAB), -30.0) if with_draft_logits else None
    logits_rows, sampled, local = [], [], []
    for slot, request in zip(slots.tolist(), requests, strict=True):
        k = request.drafts.shape[0]
        temperature[slot] = request.temperature
        logits_rows.append(request.logits)
        # Row 0's input is the last sampled token (any id); rows 1..K hold the drafts.
        sampled += [int(torch.randint(VOCAB, (), generator=g)), *request.drafts.tolist()]
        local += list(range(k + 1))
        if draft_logits is not None and k:
            # V2 stores draft logits before temperature and divides them by the slot's temperature.
            scale = request.temperature if request.temperature > 0 else 1.0
            draft_logits[slot, :k] = request.draft_probs.log() * scale
    counts = torch.tensor([r.drafts.shape[0] + 1 for r in requests])
    cu_num_logits = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])
    expanded_idx_mapping = torch.repeat_interleave(slots, counts).int()
    target_logits = torch.cat(logits_rows)  # [L, V]
    before = target_logits.clone()
    out, num_sampled = v2_rejection_sampler.rejection_sample(
        target_logits,
        draft_logits,
        torch.tensor(sampled, dtype=torch.int32),  # draft_sampled [L]
        cu_num_logits,
        torch.arange(int(counts.sum())) + 100,  # pos [L]
        slots.int(),  # idx_mapping [R]
        expanded_idx_mapping,  # [L]
        torch.tensor(local, dtype=torch.int32),  # expanded_local_pos [L]
        temperature,
        seed,
        STEPS,
    )  # [R, STEPS + 1], [R]
    # V2 may pass the model's own logits (nothing to process) and reads them again for logprobs.
    assert torch.equal(target_logits, before), "the plugin left forced rows in vLLM's logits"
    return [row[:n] for row, n in zip(out.tolist(), num_sampled.tolist(), strict=True)]


def marspec_verify(
    request: Request, rule: Rule, with_draft_logits: bool, g: torch.Generator
) -> tuple[list[int], int]:
    """marspec's rule on one request; a placeholder ends its block (V2 verifies nothing after it)."""
    drafts = request.drafts
    placeholders = (drafts < 0).nonzero()
    k = int(placeholders[0]) if placeholders.numel() else drafts.shape[0]
    logits, drafts = request.logits[: k + 1], drafts[:k]
    if request.temperature == 0:
        result = verify_greedy(logits, drafts, rule)
    else:
        probs = request.draft_probs[:k] if with_draft_logits else None
        result = verify_sampling(logits, drafts, probs, rule, 1.0, g)  # logits are already tempered
    return result.emitted(), result.n_relaxed


def check(
    rule: Rule,
    greedy_share: float,
    with_draft_logits: bool,
    seed: int,
    sampled_close_calls: bool,
    sampled_rule: Rule | None = None,
    batches: int = 6,
    pool: list[Rule | None] | None = None,
) -> None:
    """``sampled_rule``, when given, is the rule sampled requests are expected to get instead; ``pool``,
    the per-request rules each request picks one of (None: the deployment's ``rule``)."""
    plugin.activate(PluginConfig(rule, log_every=0), V2_VERIFIER)
    g = torch.Generator().manual_seed(seed)
    relaxed_total = 0
    for _ in range(batches):
        n = int(torch.randint(1, 6, (), generator=g))
        temperatures = [0.0 if torch.rand((), generator=g) < greedy_share else 0.7 for _ in range(n)]
        ks = torch.randint(0, STEPS + 1, (n,), generator=g).tolist()
        requests = [
            random_request(g, k, t, sampled_close_calls) for k, t in zip(ks, temperatures, strict=True)
        ]
        asked = (
            [pool[int(torch.randint(len(pool), (), generator=g))] for _ in requests] if pool else [None] * n
        )
        own = [a or rule for a in asked]
        plugin.counters.reset()
        try:
            ours = v2_verify(requests, with_draft_logits, g, asked)
        finally:
            request_rules._slots.clear()
        expected = [
            marspec_verify(r, mine if r.temperature == 0 else sampled_rule or mine, with_draft_logits, g)
            for r, mine in zip(requests, own, strict=True)
        ]
        assert ours == [tokens for tokens, _ in expected], f"drafts {ks}, temperatures {temperatures}"
        snapshot = plugin.counters.snapshot()
        relaxed = sum(n_relaxed for _, n_relaxed in expected)
        assert snapshot["accepted_relaxed"] == relaxed
        assert snapshot["accepted_exact"] + relaxed == sum(len(tokens) - 1 for tokens, _ in expected)
        assert snapshot["drafted"] == sum(int((r.drafts >= 0).cumprod(0).sum()) for r in requests)
        relaxed_total += relaxed
    if any(r.relaxes for r in [rule, *(p for p in pool or [] if p)]):
        assert relaxed_total > 0, f"no close call was accepted: the test did not exercise {rule.name}"


# A sampled rejection with draft logits resamples from max(0, p - q) through libdevice's log1p, which
# Triton's interpreter cannot run; greedy requests with draft logits never reach it.
CASES = [
    pytest.param(0.0, False, id="all-sampled"),
    pytest.param(0.5, False, id="mixed"),
    pytest.param(1.0, False, id="all-greedy"),
    pytest.param(1.0, True, id="all-greedy-draft-logits"),
]


@pytest.mark.parametrize("theta", [0.9, 1.0])
@pytest.mark.parametrize(("greedy_share", "with_draft_logits"), CASES)
def test_v2_verifier_with_plugin_equals_marspec_rule(
    theta: float, greedy_share: float, with_draft_logits: bool
) -> None:
    rule = Rule("mars", theta, "logit_ratio")
    seed = int(theta * 100 + greedy_share * 10 + with_draft_logits)
    check(rule, greedy_share, with_draft_logits, seed, sampled_close_calls=rule.relaxes)


@pytest.mark.parametrize(("name", "parameter"), [("typical", 0.2), ("pthresh", 0.25), ("topk", 2)])
def test_v2_verifier_with_plugin_equals_each_rival_rule(name: str, parameter: float) -> None:
    """The rivals on V2, mixed batches; sampled rows carry no close call (see test_kernels.py)."""
    check(Rule(name, parameter), 0.5, False, len(name), sampled_close_calls=False)


@pytest.mark.parametrize("window", [1, 2])
def test_v2_verifier_with_plugin_equals_fly_for_greedy_and_strict_for_sampled(window: int) -> None:
    """FLy on V2's layout: a deferral reads its own request's following draft rows, never its bonus
    row or the rows after a placeholder; sampled requests are verified strictly (see test_kernels.py)."""
    rule = Rule("fly", 0.3, window=window)
    # A deferral needs a close mismatch and `window` top-1 drafts after it: ~0.3 (window 1) and ~0.15
    # (window 2) per batch of half-greedy requests here, so more batches for the longer window.
    batches = 20 * window
    check(rule, 0.5, False, 40 + window, False, sampled_rule=Rule("strict"), batches=batches)


def test_v2_verifier_gives_each_request_its_own_rule_in_one_batch() -> None:
    """Per-request rules on V2: recorded per request-state slot (shuffled slots here), each request of a
    batch mixing the deployment's MARS, strict, a relaxing MARS, pthresh and FLy gets its own rule's
    tokens."""
    check(Rule("mars", 0.9, "logit_ratio"), 1.0, False, 11, False, batches=20, pool=REQUEST_RULES)
