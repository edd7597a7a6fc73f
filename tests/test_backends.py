"""The backend protocol: what the loop, drafters and profiler may ask of a model, and nothing more."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from conftest import TINY_VOCAB, decode_tokens, tiny_lm
from packaging.version import Version
from transformers import GenerationConfig

from marspec.backends import CausalLM, ForwardClock, HFCausalLM
from marspec.backends.hf import GROUPED_SDPA, cache_keyword, use_grouped_attention
from marspec.drafters import Draft, Drafter, HybridDrafter, ModelDrafter, NgramDrafter
from marspec.drafters.tree import build_tree
from marspec.rules import Rule


class BigramLM:
    """A second backend with no transformers in it: logits depend on the last token only (a random
    bigram table), and its "cache" is the list of tokens seen. Enough to drive the whole loop."""

    def __init__(self, seed: int, name: str = "bigram") -> None:
        self.table = torch.randn(TINY_VOCAB, TINY_VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
        self.name = name
        self.vocab_size = TINY_VOCAB
        self.context_length = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.device = torch.device("cpu")
        self.clock = ForwardClock()
        self.tokens: list[int] = []

    @property
    def cached_len(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens = []

    def keep_prefix(self, ids: torch.Tensor) -> int:
        kept = 0
        for cached, new in zip(self.tokens, ids.tolist(), strict=False):  # the shorter decides
            if cached != new:
                break
            kept += 1
        self.tokens = self.tokens[:kept]
        return kept

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        self.tokens += tokens.tolist()
        self.clock.tick(0.0)
        rows = self.table[tokens]  # [n, V]
        return rows[-1:] if last_only else rows

    def forward_tree(self, tree, root):
        nodes = torch.cat((root, tree.tokens))
        self.tokens += nodes.tolist()
        self.clock.tick(0.0)
        return self.table[nodes]

    def keep_path(self, base: int, path: tuple[int, ...]) -> None:
        kept = [self.tokens[base + node] for node in path]
        self.tokens = self.tokens[: base + 1] + kept

    def rollback(self, length: int) -> None:
        self.tokens = self.tokens[:length]


def test_backends_and_drafters_satisfy_their_protocols(target):
    assert isinstance(target, CausalLM) and isinstance(BigramLM(0), CausalLM)
    model = ModelDrafter(tiny_lm(1), target_vocab_size=target.vocab_size)
    for drafter in (model, NgramDrafter(), HybridDrafter(model)):
        assert isinstance(drafter, Drafter)
    assert NgramDrafter().draft_model is None and HybridDrafter(model).draft_model is model.draft_model


def test_a_backend_without_transformers_runs_the_loop_exactly(prompt):
    target = BigramLM(0, "bigram-target")
    plain, _ = decode_tokens(target, None, prompt, max_new_tokens=30)
    expected, last = [], int(prompt[-1])
    for _ in range(30):
        last = int(torch.argmax(target.table[last]))
        expected.append(last)
    assert plain == expected
    drafter = ModelDrafter(BigramLM(1, "bigram-draft"), target_vocab_size=TINY_VOCAB)
    spec, stats = decode_tokens(target, drafter, prompt, rule=Rule("strict"), k=4, max_new_tokens=30)
    assert spec == plain and stats.rejected > 0
    tree, _ = decode_tokens(target, drafter, prompt, rule=Rule("strict"), k=4, max_new_tokens=30, tree=(2, 2))
    assert tree == plain


def test_clocks_count_forwards_and_the_loop_reads_them(target, prompt):
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    before = (target.clock.calls, drafter.draft_model.clock.calls)
    _, stats = decode_tokens(target, drafter, prompt, rule=Rule("strict"), k=3, max_new_tokens=20)
    assert target.clock.calls - before[0] == stats.target_forwards + 1  # + the prefill
    assert drafter.draft_model.clock.calls - before[1] == stats.draft_forwards > 0
    # timing-guard: the prefill is one of the forwards target_forward_s sums (a part of it, not a speed)
    assert stats.draft_forward_s > 0 and 0 < stats.prefill_s <= stats.target_forward_s
    _, lookup = decode_tokens(target, NgramDrafter(), prompt, rule=Rule("strict"), k=3, max_new_tokens=20)
    assert lookup.draft_forwards == 0 and lookup.draft_forward_s == 0.0


def test_eos_ids_gather_every_source_the_checkpoint_declares():
    lm = tiny_lm(0)
    lm.model.generation_config = GenerationConfig(eos_token_id=[5, 7])
    lm.model.config.eos_token_id = 9
    assert HFCausalLM(lm.model, tokenizer=None, name="tiny").eos_token_ids == {5, 7, 9}
    assert lm.device == torch.device("cpu")


def test_the_position_cache_scores_exactly_like_transformers_dynamic_cache():
    """Appends of 1 and many tokens, rollbacks, growth past the first buffer and a new sequence: every
    logit equals the DynamicCache's, bit for bit."""
    base = tiny_lm(0)
    ours = HFCausalLM(base.model, tokenizer=None, name="tiny")
    theirs = HFCausalLM(base.model, tokenizer=None, name="tiny", position_cache=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second sequence reuses the grown buffers
        for lm in (ours, theirs):
            lm.reset()
        prompt = torch.randint(0, TINY_VOCAB, (40,), generator=gen)
        assert torch.equal(ours.forward(prompt, last_only=True), theirs.forward(prompt, last_only=True))
        while ours.cached_len < 300:  # past the initial 256 positions
            size = int(torch.randint(1, 9, (1,), generator=gen))
            chunk = torch.randint(0, TINY_VOCAB, (size,), generator=gen)
            assert torch.equal(ours.forward(chunk), theirs.forward(chunk))
            keep = ours.cached_len - int(torch.randint(0, len(chunk), (1,), generator=gen))
            ours.rollback(keep)
            theirs.rollback(keep)
            assert ours.cached_len == theirs.cached_len == keep
    layer = ours._cache.layers[0]
    assert layer.keys.shape[-2] == ours.cached_len and layer._key_buf.shape[-2] == 512


def test_forwards_pass_the_cache_by_the_keyword_this_transformers_names_it():
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` and warns on the old name:
    chain and tree forwards use the name the model's forward takes and warn about nothing."""
    lm = tiny_lm(0)
    expected = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert cache_keyword(lm.model) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lm.forward(torch.tensor([1, 2, 3]))
        draft = Draft(tokens=torch.tensor([4, 5]), alternatives=torch.tensor([[6], [7]]))
        lm.forward_tree(build_tree(draft, (2, 2)), torch.tensor([8]))


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.23"),
    reason="marspec's grouped attention is checked against transformers >= 5.23's SDPA path only",
)
def test_grouped_query_attention_with_masks_changes_no_logit(monkeypatch):
    """use_grouped_attention lets SDPA group key/value heads in masked (multi-token, tree) forwards: the
    logits must be bit for bit those of transformers' head-expanding path it replaces, and it must change
    only the model it is given."""
    lm = tiny_lm(0)  # 4 query heads share 2 key/value heads
    other = tiny_lm(1)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, TINY_VOCAB, (60,), generator=gen)
    block = torch.randint(0, TINY_VOCAB, (13,), generator=gen)
    draft = Draft(tokens=block[1:5], alternatives=block[5:9, None])
    from transformers.integrations import sdpa_attention

    expanded = {"sdpa": 0, GROUPED_SDPA: 0}
    original = sdpa_attention.repeat_kv

    def counting_repeat_kv(states, n_rep):
        expanded[lm.model.config._attn_implementation] += 1
        return original(states, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting_repeat_kv)
    out = {}
    for grouped in (False, True):
        if grouped:
            assert use_grouped_attention(lm.model)
        lm.reset()
        lm.forward(prompt, last_only=True)
        verify = lm.forward(block)
        lm.rollback(len(prompt))
        tree = lm.forward_tree(build_tree(draft, (2, 2)), block[:1])
        out[grouped] = (verify, tree)
    assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])
    assert expanded["sdpa"] > 0 and expanded[GROUPED_SDPA] == 0  # the two paths really differ
    assert other.model.config._attn_implementation == "sdpa"  # no other model changed
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ


class _DeviceEvent:
    """Stands in for a CUDA timing event (none can be made on a CPU-only torch): it knows when it was
    recorded and whether the device has passed it."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: _DeviceEvent) -> float:
        assert end.waited, "read before the device passed the forward's end"
        return end.at_ms - self.at_ms


def test_a_clock_reads_device_events_only_when_its_seconds_are_read():
    clock = ForwardClock()
    clock.tick(0.5)
    first, second = (_DeviceEvent(10.0), _DeviceEvent(35.0)), (_DeviceEvent(40.0), _DeviceEvent(41.0))
    clock.record(*first)
    clock.record(*second)
    assert clock.calls == 3 and not first[1].waited  # counted at once, timed later
    assert clock.seconds == pytest.approx(0.5 + 0.025 + 0.001)
    assert clock.last == pytest.approx(0.001)  # the most recent forward, which decode's prefill uses
    assert clock.seconds == pytest.approx(0.526)  # each pair is read once


def test_cpu_forwards_are_timed_with_the_wall_clock(target):
    from marspec.backends.timing import ForwardTimer

    assert not ForwardTimer(torch.device("cpu"), ForwardClock()).events  # the CPU has no timing events
    before = target.clock.calls
    target.reset()
    target.forward(torch.tensor([1, 2, 3]))
    assert target.clock.calls == before + 1 and target.clock.last > 0
