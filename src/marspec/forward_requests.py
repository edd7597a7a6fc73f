"""Model forwards as data: the decode loop asks for its forwards instead of calling them.

A sequence's decoding is a generator (:func:`marspec.decode.decode_steps`, and what runs on it) that
yields a :class:`Forward` or :class:`TreeForward` where it needs a model's logits and receives them
through ``send``. Whoever drives it decides how the forward runs: one sequence alone runs it at once
(:func:`run_alone`, :func:`solo`); the batch scheduler (:mod:`marspec.batch.scheduler`) gathers the
forwards every live sequence waits for and runs those of one model as one forward. A forward that fails
is thrown into the generator that asked for it, where it fails that sequence alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import torch

from marspec.interfaces import CausalLM, Draft, Drafter, DraftTree

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class Forward:
    """``lm.forward(tokens, last_only)``, asked for: logits [n, V] (or [1, V] with ``last_only``)."""

    lm: CausalLM
    tokens: torch.Tensor  # long[n]
    last_only: bool = False

    def run(self) -> torch.Tensor:
        return self.lm.forward(self.tokens, self.last_only)


@dataclass(eq=False)
class TreeForward:
    """``lm.forward_tree(tree, root)``, asked for: logits [1 + nodes, V]."""

    lm: CausalLM
    tree: DraftTree
    root: torch.Tensor  # long[1]

    def run(self) -> torch.Tensor:
        return self.lm.forward_tree(self.tree, self.root)


Request = Forward | TreeForward
# A computation that asks for forwards and returns R: what a drafter's proposal or one sequence is.
Asks = Generator[Request, torch.Tensor, R]


def run_alone(work: Asks[R]) -> R:
    """``work``'s value, each forward it asks for run at once (one sequence on its own)."""
    outputs = solo(work)
    try:
        output = next(outputs)
    except StopIteration as done:
        return done.value
    outputs.close()
    raise TypeError(f"a computation that asks only for forwards yielded {output!r}")


def solo(work: Generator[Request | T, torch.Tensor | None, R]) -> Generator[T, None, R]:
    """``work`` with each forward it asks for run at once: yields what else it yields (a sequence's
    steps, its text), returns what it returns. A forward that raises is thrown into ``work`` where it
    asked, as the batch scheduler does; closing this closes ``work``."""
    reply: torch.Tensor | None = None
    error: BaseException | None = None
    try:
        while True:
            try:
                item = work.send(reply) if error is None else work.throw(error)
            except StopIteration as done:
                return done.value
            reply = error = None
            if isinstance(item, (Forward, TreeForward)):
                try:
                    reply = item.run()
                except BaseException as exc:  # handed to the computation that asked, whatever it is
                    error = exc
            else:
                yield item
    finally:
        work.close()


class ProposesInSteps:
    """A drafter whose ``propose`` is its ``propose_steps`` with each forward run at once (one sequence
    on its own), so that it writes the proposal once, as forwards asked for."""

    propose_steps: Callable[..., Asks[Draft]]

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        temperature: float,
        generator: torch.Generator | None,
        alternatives: int = 0,
        distributions: bool = False,
    ) -> Draft:
        return run_alone(self.propose_steps(context, k, temperature, generator, alternatives, distributions))


def propose(
    drafter: Drafter,
    context: torch.Tensor,
    k: int,
    temperature: float,
    generator: torch.Generator | None,
    alternatives: int = 0,
    distributions: bool = False,
) -> Asks[Draft]:
    """``drafter``'s proposal, asking for the forwards it needs: its ``propose_steps`` where it has one
    (a drafter that runs a model's forwards), else its ``propose`` (one that runs none of its own, or
    runs them itself)."""
    if asks_forwards(type(drafter)):
        steps = drafter.propose_steps  # type: ignore[attr-defined]
        return (yield from steps(context, k, temperature, generator, alternatives, distributions))
    extra = {"distributions": True} if distributions else {}
    return drafter.propose(context, k, temperature, generator, alternatives, **extra)


@functools.cache
def asks_forwards(kind: type) -> bool:
    """Whether drafters of class ``kind`` propose through ``propose_steps``: they have one, and ``propose``
    is not overridden below it (a subclass that changes only ``propose`` is run by its ``propose``)."""
    order = kind.__mro__
    steps_at = next((i for i, c in enumerate(order) if "propose_steps" in vars(c)), None)
    propose_at = next((i for i, c in enumerate(order) if "propose" in vars(c)), None)
    return steps_at is not None and (propose_at is None or propose_at >= steps_at)


def cannot_batch(drafter: object) -> str:
    """The line for a drafter that has no twin for a batch's sequences (no ``for_slot``)."""
    return (
        f"decoding several sequences together cannot give each its own {type(drafter).__name__}: decode them "
        "one at a time (Decoder.generate)"
    )
