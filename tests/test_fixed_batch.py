"""The fixed-shape path with a batch dimension (marspec.backends.fixed_batch, issue 69's GPU half) on tiny
random models, on the CPU, where it runs uncaptured: a slot's rows do not depend on the other slots' bit
for bit and match its own fixed-shape forward (chains, token trees, last rows, slots idle between
forwards, buffers grown mid-sequence), decoding several sequences together gives each its solo tokens,
the captured region reads nothing from the host, and what cannot batch here is refused in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from captured_reads import captured_regions_counted
from conftest import tiny_lm
from test_batch import MIXED, PROMPTS, solo

from marspec.backends.fixed import INITIAL_CAPACITY, QUERY_SIZES, FixedShapeLM, bucket
from marspec.backends.fixed_batch import (
    BATCH_SIZES,
    HIDDEN_STATES_REFUSAL,
    SPILL,
    FixedBatch,
    SlotRows,
)
from marspec.backends.quantize import rowwise_int8_available
from marspec.batch.scheduler import Scheduler, batching_note, default_max_batch, shares_forwards
from marspec.batch.slots import batched_form, check_batchable
from marspec.drafters.tree import build_tree
from marspec.errors import MarspecError
from marspec.interfaces import Draft
from marspec.selftest.tiny import tiny_decoder

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-fixed")


@pytest.fixture(scope="module")
def fixed(folder: Path):
    """The tiny pair on the fixed-shape path (graphs="on", uncaptured on the CPU): an fp32 target with
    SDPA attention, batched here; the CPU's 4-bit draft attends row by row, so it is packed instead."""
    return tiny_decoder(folder, CPU, graphs="on")


def _alone(base: FixedShapeLM, n: int) -> list[FixedShapeLM]:
    return [FixedShapeLM(base.model, base.tokenizer, base.name) for _ in range(n)]


def _keys(layer_keys: torch.Tensor, length: int) -> torch.Tensor:
    return layer_keys[..., :length, :]


def assert_solo(got: torch.Tensor, want: torch.Tensor) -> None:
    """A slot's rows against its own one-sequence forward: the same up to the CPU SDPA's rounding by a
    forward's row count (a one-token row inside a 16-row forward: bit for bit with torch 2.13 here,
    ~1e-5 apart with torch 2.11), far inside what another slot's rows or a wrong mask would change."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# (slot: tokens, last_only) per forward: prompts in chunks, verifications, single tokens; slots that score
# nothing in a forward (idle, or their sequence ended) keep their caches as they are; past the first
# capacity the buffers grow.
PLAN = [
    {0: (7, True), 1: (12, False), 2: (3, False), 3: (30, True), 4: (1, False)},
    {0: (1, False), 1: (13, False), 3: (5, False), 4: (16, False)},
    {1: (1, False), 4: (9, True)},
    *[{2: (32, False), 0: (13, False), 1: (2, False)} for _ in range(9)],
]
KEPT = (0, 2, 4)  # slots given the same tokens in both batches; the others differ


def test_a_slots_rows_do_not_depend_on_the_other_slots_and_match_its_solo_forward(fixed) -> None:
    """Two batches over the same model score the same tokens in slots 0, 2, 4 and different ones in 1
    and 3: the kept slots' logits and caches are the same bits in both, and each slot's rows are its
    own one-sequence fixed-shape forward's (:func:`assert_solo`)."""
    base = fixed.target
    batches = [FixedBatch(base), FixedBatch(base)]
    for batch in batches:
        assert [batch.claim() for _ in range(5)] == [0, 1, 2, 3, 4]  # forwards of 8 rows of batch
    alone = [_alone(base, 5), _alone(base, 5)]
    ids = torch.Generator().manual_seed(0)
    cached = [0] * 5
    for forward in PLAN:
        drawn = {
            slot: [torch.randint(0, 60, (n,), generator=ids) for _ in batches]
            for slot, (n, _) in forward.items()
        }
        outs = []
        for which, batch in enumerate(batches):
            calls = [
                SlotRows(slot, cached[slot], drawn[slot][0 if slot in KEPT else which], last_only=last_only)
                for slot, (_, last_only) in forward.items()
            ]
            outs.append(batch.run(calls))
            for call, logits in zip(calls, outs[-1], strict=True):
                assert_solo(logits, alone[which][call.slot].forward(call.tokens, last_only=call.last_only))
        for slot, first, second in zip(forward, *outs, strict=True):
            assert slot not in KEPT or torch.equal(first, second), slot
        for slot, (n, _) in forward.items():
            cached[slot] += n
    assert max(cached) > INITIAL_CAPACITY and batches[0]._capacity > INITIAL_CAPACITY
    first, second = (batch._cache for batch in batches)
    assert first is not None and second is not None
    for slot in range(5):
        n = cached[slot]
        solo_cache = alone[0][slot]._fixed_cache
        assert solo_cache is not None
        for mine, other, its in zip(first.layers, second.layers, solo_cache.layers, strict=True):
            assert_solo(_keys(mine.keys[slot], n), _keys(its.keys[0], n))
            assert_solo(_keys(mine.values[slot], n), _keys(its.values[0], n))
            if slot in KEPT:
                assert torch.equal(_keys(mine.keys[slot], n), _keys(other.keys[slot], n))
                assert torch.equal(_keys(mine.values[slot], n), _keys(other.values[slot], n))


def test_token_tree_rows_beside_a_chain_match_the_solo_tree_forward(fixed) -> None:
    base = fixed.target
    batch = FixedBatch(base)
    tree_slot, chain_slot = batch.claim(), batch.claim()
    alone = _alone(base, 2)
    prompt = torch.arange(3, 20)
    for slot in (tree_slot, chain_slot):
        batch.run([SlotRows(slot, 0, prompt)])
        alone[slot].forward(prompt)
    draft = Draft(tokens=torch.tensor([3, 4, 5]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12]]))
    tree, root, chain = build_tree(draft, (3, 2)), torch.tensor([2]), torch.arange(30, 43)
    n = len(prompt)
    got_tree, got_chain = batch.run(
        [SlotRows(tree_slot, n, torch.cat((root, tree.tokens)), tree), SlotRows(chain_slot, n, chain)]
    )
    assert_solo(got_tree, alone[tree_slot].forward_tree(tree, root))
    assert_solo(got_chain, alone[chain_slot].forward(chain))


def test_sizes_are_bucketed_and_one_call_per_slot(fixed) -> None:
    assert [bucket(BATCH_SIZES, n) for n in (1, 3, 5, 17, 64, 65)] == [1, 4, 8, 32, 64, 65]
    assert QUERY_SIZES[-1] == SPILL
    batch = FixedBatch(fixed.target)
    slot = batch.claim()
    with pytest.raises(ValueError, match="one call per slot"):
        batch.run([SlotRows(slot, 0, torch.tensor([1])), SlotRows(slot, 0, torch.tensor([2]))])


def test_the_batched_forward_reads_nothing_from_the_host_inside_the_captured_region() -> None:
    """transformers' SDPA attention (the GPU's), chains, a token tree and last rows in one forward, and
    a forward where a slot has no rows: no host read of anything computed from the inputs."""
    lm = tiny_lm(5)
    assert lm.model.config._attn_implementation == "sdpa"
    batch = FixedBatch(FixedShapeLM(lm.model, None, "fixed"))
    slots = [batch.claim() for _ in range(3)]
    draft = Draft(tokens=torch.tensor([3, 4, 5]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12]]))
    tree = build_tree(draft, (3, 2))
    with captured_regions_counted(batch) as inside:
        batch.run([SlotRows(slot, 0, torch.arange(10, 20), last_only=True) for slot in slots])
        batch.run(
            [
                SlotRows(slots[0], 10, torch.cat((torch.tensor([2]), tree.tokens)), tree),
                SlotRows(slots[2], 10, torch.arange(1, 14)),
            ]
        )
    assert inside == [0, 0]


# Token trees beside chains: a tree's kept path moves off-chain nodes within its slot's buffers.
TREES = [{"rule": "strict", "tree": "3,2"}, {"rule": "mars", "theta": 0.3, "tree": "2,2,1"}]


def test_each_sequence_decodes_its_solo_tokens_inside_a_batch(fixed, caplog) -> None:
    """Mixed rules, k, lengths, greedy and seeded sampling, token trees, eight prompts through four
    slots (sequences join as others leave): each answer is its solo run's, token for token."""
    prompts, settings = PROMPTS + PROMPTS[:2], MIXED + TREES
    with caplog.at_level(logging.WARNING, logger="marspec.batch"):
        got = fixed.generate_many(prompts, per_prompt=settings, max_batch=4, max_new_tokens=24, chat=False)
    want = solo(fixed, prompts, settings, max_new_tokens=24, chat=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    notes = [record.getMessage() for record in caplog.records]
    assert notes == [f"marspec: {batching_note(fixed.target, 4)}"]


def test_strict_equals_plain_and_mars_at_theta_one_equals_strict_inside_a_batch(fixed) -> None:
    runs = {
        name: [
            r.token_ids
            for r in fixed.generate_many(PROMPTS, max_batch=3, max_new_tokens=20, chat=False, **settings)
        ]
        for name, settings in (
            ("plain", {"rule": "plain"}),
            ("strict", {"rule": "strict"}),
            ("mars1", {"rule": "mars", "theta": 1.0}),
        )
    }
    assert runs["strict"] == runs["plain"]
    assert runs["mars1"] == runs["strict"]


def test_how_each_engine_shares_forwards_and_what_the_user_is_told(fixed, folder: Path) -> None:
    target = fixed.target
    assert batched_form(target) == "fixed" and not shares_forwards(target)
    assert default_max_batch(target) == 1  # batched forwards may round by the batch: asked for, not given
    assert batching_note(target, 1) is None
    note = batching_note(target, 4)
    assert note is not None and "\n" not in note
    assert note.startswith("max_batch 4: ") and note.endswith("with max_batch 1 every answer is its solo one")
    assert batching_note(target, 8, "--max-batch").startswith("--max-batch 8: ")
    assert batched_form(fixed.drafter.draft_model) == "packed"  # the 4-bit draft attends row by row
    if rowwise_int8_available():
        int8 = tiny_decoder(folder, CPU, graphs="on", target_quant="int8")
        assert batched_form(int8.target) == "packed" and batching_note(int8.target, 4) is None


def test_a_model_keeping_hidden_states_is_refused_in_one_line() -> None:
    lm = FixedShapeLM(tiny_lm(6).model, None, "fixed")
    lm.capture_hidden_states((1,))
    with pytest.raises(MarspecError) as caught:
        check_batchable(lm, None)
    assert str(caught.value) == HIDDEN_STATES_REFUSAL
    with pytest.raises(MarspecError, match="EAGLE-3"):
        Scheduler(lm, None, max_batch=2)
