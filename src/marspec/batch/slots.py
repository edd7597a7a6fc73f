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
from marspec.batch.views import FixedSlotLM, SlotLM
from marspec.errors import MarspecError
from marspec.forward_requests import cannot_batch
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
    if isinstance(target, FixedShapeLM) and target.captures_hidden_states:
        raise MarspecError(HIDDEN_STATES_REFUSAL)
    _drafter_for(drafter, target, _checked)  # its twin over the pair's own models: what it would refuse


def make_slot(
    target: HFCausalLM,
    drafter: Drafter | None,
    prefill_chunk: int,
    draft_cap: Callable[[], int] | None = None,
) -> Slot:
    """A new slot over the pair's models: caches of its own, its forwards run by the batch."""
    view = _view(target, prefill_chunk)
    return Slot(view, _drafter_for(drafter, view, lambda lm: _view(lm, prefill_chunk)), draft_cap)


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


def _view(lm: CausalLM, prefill_chunk: int) -> SlotLM:
    """One sequence's view of ``lm``'s model (:func:`batched_form`): a slot of its batched fixed-shape
    forwards, or a cache of its own in the batch's eager forwards."""
    lm = _checked(lm)
    if batched_form(lm) == "fixed":
        return FixedSlotLM(lm)  # type: ignore[arg-type]
    return SlotLM(lm, prefill_chunk)


def _checked(lm: CausalLM) -> HFCausalLM:
    """``lm``, which a batch can give each sequence a view of (a transformers model), or a one-line error."""
    if not isinstance(lm, HFCausalLM):
        raise MarspecError(
            f"decoding several sequences together needs transformers models, and {lm.name!r} is not one: "
            "decode one at a time (Decoder.generate)"
        )
    return lm


def _drafter_for(
    drafter: Drafter | None, target: CausalLM, view: Callable[[CausalLM], CausalLM]
) -> Drafter | None:
    """``drafter``'s twin for one slot, which the drafter makes itself (its ``for_slot``): the same
    settings, its own state (a draft model's cache through ``view``; an EAGLE-3 head's cache, reading the
    slot's ``target``)."""
    if drafter is None:
        return None
    twin = getattr(drafter, "for_slot", None)
    if twin is None:
        raise MarspecError(cannot_batch(drafter))
    return twin(target, view)
