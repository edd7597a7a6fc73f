"""A batch's slots: each sequence's own view of the target and its own drafter, over the pair's models.

A slot is made once and reused by the sequences that follow (a server's requests): its caches keep the
last sequence's tokens, so the next one keeps the prefix it shares with them, as a lone Decoder does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from marspec.backends.fixed import FixedShapeLM
from marspec.backends.hf import HFCausalLM
from marspec.batch.batcher import Batcher, SlotLM
from marspec.drafters.eagle3 import Eagle3Drafter
from marspec.drafters.hybrid import HybridDrafter
from marspec.drafters.model import ModelDrafter
from marspec.drafters.ngram import NgramDrafter
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Drafter

FIXED_SHAPE_REFUSAL = (
    "decoding several sequences together runs the eager engine, and this pair was loaded on the fixed-shape "
    "path (graphs): load the Decoder with graphs='off' (--graphs off)"
)


@dataclass(frozen=True)
class Slot:
    """One sequence's target view (its own KV cache) and drafter (its own draft cache)."""

    target: CausalLM  # a SlotLM, or the pair's own target when sequences run one at a time
    drafter: Drafter | None
    # The most tokens the sequence may draft at this step where its output does not depend on its drafts
    # (marspec.decode.DecodeConfig.drafts_leave_output); None: no bound beyond its own k.
    draft_cap: Callable[[], int] | None = None


def check_batchable(target: HFCausalLM, drafter: Drafter | None) -> None:
    """Raise a one-line error unless sequences of this pair can be decoded together (before any work)."""
    models = [target] + ([drafter.draft_model] if drafter is not None else [])
    if any(isinstance(lm, FixedShapeLM) for lm in models):
        raise MarspecError(FIXED_SHAPE_REFUSAL)
    if not isinstance(target, HFCausalLM):
        raise MarspecError(f"decoding several sequences together needs a transformers target, not {target!r}")
    _drafter_for(drafter, None, None, 0, check_only=True)


def make_slot(
    target: HFCausalLM,
    drafter: Drafter | None,
    batcher: Batcher,
    prefill_chunk: int,
    draft_cap: Callable[[], int] | None = None,
) -> Slot:
    """A new slot over the pair's models: caches of its own, forwards run by ``batcher``."""
    view = SlotLM(target, batcher, prefill_chunk)
    return Slot(view, _drafter_for(drafter, view, batcher, prefill_chunk), draft_cap)


def _drafter_for(
    drafter: Drafter | None,
    target: SlotLM | None,
    batcher: Batcher | None,
    prefill_chunk: int,
    check_only: bool = False,
) -> Drafter | None:
    """``drafter``'s twin for one slot: the same settings, its own state (a draft model's cache; an
    EAGLE-3 head's cache, reading the slot's target states). ``check_only``: only refuse what has none."""
    if drafter is None:
        return None
    if isinstance(drafter, NgramDrafter):
        return NgramDrafter(drafter.max_ngram, drafter.min_ngram)
    if isinstance(drafter, HybridDrafter):
        model = _drafter_for(drafter.model, target, batcher, prefill_chunk, check_only)
        if check_only:
            return drafter
        assert model is not None
        return HybridDrafter(model, NgramDrafter(drafter.lookup.max_ngram, drafter.lookup.min_ngram))
    if isinstance(drafter, ModelDrafter) and isinstance(drafter.draft_model, HFCausalLM):
        if check_only:
            return drafter
        assert batcher is not None
        view = SlotLM(drafter.draft_model, batcher, prefill_chunk)
        return ModelDrafter(view, drafter.target_vocab_size, drafter.min_confidence, drafter.stop_chunk)
    if isinstance(drafter, Eagle3Drafter):
        if check_only:
            return drafter
        assert target is not None
        head = drafter.draft_model
        return Eagle3Drafter(head.head, target, drafter.layers, drafter.name, drafter.min_confidence)
    raise MarspecError(
        f"decoding several sequences together cannot give each its own {type(drafter).__name__}: decode them "
        "one at a time (Decoder.generate)"
    )
