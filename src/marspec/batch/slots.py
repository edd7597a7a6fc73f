"""A batch's slots: each sequence's own view of the target and its own drafter, over the pair's models.

A slot is made once and reused by the sequences that follow (a server's requests): its caches keep the
last sequence's tokens, so the next one keeps the prefix it shares with them, as a lone Decoder does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from marspec.backends.fixed import FixedShapeLM
from marspec.backends.fixed_batch import HIDDEN_STATES_REFUSAL
from marspec.backends.hf import HFCausalLM
from marspec.backends.packed import rows_alone
from marspec.backends.row_attention import ROW_ATTENTION
from marspec.batch.batcher import Batcher, FixedSlotLM, SlotLM
from marspec.drafters.eagle3 import Eagle3Drafter
from marspec.drafters.hybrid import HybridDrafter
from marspec.drafters.model import ModelDrafter
from marspec.drafters.ngram import NgramDrafter
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Drafter


@dataclass(frozen=True)
class Slot:
    """One sequence's target view (its own KV cache) and drafter (its own draft cache)."""

    target: CausalLM  # a SlotLM, or the pair's own target when sequences run one at a time
    drafter: Drafter | None
    # The most tokens the sequence may draft at this step where its output does not depend on its drafts
    # (marspec.decode.DecodeConfig.drafts_leave_output); None: no bound beyond its own k.
    draft_cap: Callable[[], int] | None = None

    def release(self) -> None:
        """Give back what the slot holds in shared buffers (the batched fixed-shape path's slots); the
        slot is not used again."""
        for lm in (self.target, getattr(self.drafter, "draft_model", None)):
            if isinstance(lm, FixedSlotLM):
                lm.release()


def check_batchable(target: HFCausalLM, drafter: Drafter | None) -> None:
    """Raise a one-line error unless sequences of this pair can be decoded together (before any work)."""
    if not isinstance(target, HFCausalLM):
        raise MarspecError(f"decoding several sequences together needs a transformers target, not {target!r}")
    if batched_form(target) == "fixed" and target.captures_hidden_states:
        raise MarspecError(HIDDEN_STATES_REFUSAL)
    _drafter_for(drafter, None, None, 0, check_only=True)


def make_slot(
    target: HFCausalLM,
    drafter: Drafter | None,
    batcher: Batcher,
    prefill_chunk: int,
    draft_cap: Callable[[], int] | None = None,
) -> Slot:
    """A new slot over the pair's models: caches of its own, forwards run by ``batcher``."""
    view = _view(target, batcher, prefill_chunk)
    return Slot(view, _drafter_for(drafter, view, batcher, prefill_chunk), draft_cap)


def batched_form(lm: HFCausalLM) -> str:
    """How sequences decoded together share ``lm``'s model's forwards: ``"packed"`` (one eager forward,
    each row computed alone: exact, :mod:`marspec.backends.packed`; a model on the fixed-shape path
    whose attention runs row by row is packed too, its fixed shapes being only padding on the CPU),
    ``"fixed"`` (the fixed-shape path's batched forwards, :mod:`marspec.backends.fixed_batch`), or
    ``"alone"`` (each sequence its own eager forward, in turn: a model whose rows a batch would change)."""
    if isinstance(lm, FixedShapeLM):
        if getattr(lm.model.config, "_attn_implementation", None) == ROW_ATTENTION:
            return "alone" if lm.captures_hidden_states else "packed"
        # Dynamically quantised linears scale a whole forward at once: other rows would change a row.
        return "fixed" if lm.pads else "alone"
    return "packed" if rows_alone(lm) else "alone"


def _view(lm: HFCausalLM, batcher: Batcher, prefill_chunk: int) -> SlotLM | FixedSlotLM:
    """One sequence's view of ``lm``'s model (:func:`batched_form`): a slot of its batched fixed-shape
    forwards, or a cache of its own in the batch's eager forwards."""
    if batched_form(lm) == "fixed":
        return FixedSlotLM(lm, batcher)
    return SlotLM(lm, batcher, prefill_chunk)


def _drafter_for(
    drafter: Drafter | None,
    target: SlotLM | FixedSlotLM | None,
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
        view = _view(drafter.draft_model, batcher, prefill_chunk)
        return ModelDrafter(view, drafter.target_vocab_size, drafter.min_confidence, drafter.stop_chunk)
    if isinstance(drafter, Eagle3Drafter):
        if isinstance(drafter.target, FixedShapeLM):
            raise MarspecError(HIDDEN_STATES_REFUSAL)
        if check_only:
            return drafter
        assert target is not None
        head = drafter.draft_model
        return Eagle3Drafter(head.head, target, drafter.layers, drafter.name, drafter.min_confidence)
    raise MarspecError(
        f"decoding several sequences together cannot give each its own {type(drafter).__name__}: decode them "
        "one at a time (Decoder.generate)"
    )
