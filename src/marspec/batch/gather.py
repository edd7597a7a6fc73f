"""The forwards of one model that a batch's sequences ask for at a step, run as one where that is exact.

Where the model computes rows alone the chains are packed into one forward
(:func:`marspec.backends.packed.forward_packed`); the fixed-shape path runs every slot's forward as one
batched forward (:meth:`marspec.batch.views.FixedSlotLM.batch_forward`); anything else runs sequence by
sequence. One sequence's input must not fail the others (:func:`deliver`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from marspec.backends.packed import forward_packed, rows_alone
from marspec.batch.views import FixedSlotLM
from marspec.forward_requests import Forward, Request

# What each request of a group got: its logits, or the exception its forward raised.
Outcome = torch.Tensor | BaseException


def run_group(requests: Sequence[Request]) -> list[Outcome]:
    """Run ``requests`` (forwards of one model, one per sequence, each on the sequence's own cache):
    packed or batched into one forward where that gives each its own forward's bits, else one by one."""
    if isinstance(requests[0].lm, FixedSlotLM):  # every sequence of a model on the fixed path: one forward
        return deliver(requests, lambda group: group[0].lm.batch_forward(group))  # type: ignore[attr-defined]
    packable = [
        i
        for i, r in enumerate(requests)
        if len(requests) > 1 and isinstance(r, Forward) and rows_alone(r.lm)  # type: ignore[arg-type]
    ]
    outcomes: list[Outcome | None] = [None] * len(requests)
    if len(packable) > 1:
        packed = deliver([requests[i] for i in packable], _packed)
        for i, outcome in zip(packable, packed, strict=True):
            outcomes[i] = outcome
    for i, request in enumerate(requests):
        if outcomes[i] is None:
            outcomes[i] = deliver([request], lambda group: [group[0].run()])[0]
    return outcomes  # type: ignore[return-value]


def _packed(group: Sequence[Request]) -> list[torch.Tensor]:
    if len(group) == 1:
        return [group[0].run()]
    return forward_packed([(r.lm, r.tokens, r.last_only) for r in group])  # type: ignore[union-attr,misc]


def deliver(
    requests: Sequence[Request], run: Callable[[Sequence[Request]], list[torch.Tensor]]
) -> list[Outcome]:
    """Run ``requests`` as one forward (``run``): each one's logits, or its error.

    One sequence's input must not fail the others: when a forward of several requests raises, each is
    run again on its own, so the error reaches only the sequences whose own forward raises it and the
    rest get the logits they would have got (a failed forward leaves every cache as it was: the packed
    one crops what it wrote, the fixed-shape one advances a slot's length only after success)."""
    try:
        return list(run(requests))
    except Exception as exc:
        if len(requests) == 1:
            return [exc]
        return [deliver([request], run)[0] for request in requests]
    except BaseException as exc:  # an interrupt: every sequence of the forward sees it
        return [exc] * len(requests)
