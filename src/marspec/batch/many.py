"""Several prompts decoded together by one Decoder: :meth:`marspec.Decoder.generate_many` and
:meth:`marspec.Decoder.stream_many` (the library's face of :mod:`marspec.batch.scheduler`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from marspec.batch.scheduler import Scheduler, Work, batching_note, settle_max_batch
from marspec.batch.slots import Slot
from marspec.decode import DecodeConfig
from marspec.errors import MarspecError
from marspec.forward_requests import Request
from marspec.interfaces import CausalLM, Drafter
from marspec.prompting import Prompt
from marspec.settings import GenerationOptions

log = logging.getLogger("marspec.batch")

# What a generation returns (marspec.api.GenerationResult); this module sits below marspec.api.
GenerationResult = Any


class Decoder(Protocol):
    """What decoding several prompts needs of a :class:`marspec.Decoder` (which imports this module)."""

    target: CausalLM
    drafter: Drafter | None

    def settle(self, opts: GenerationOptions) -> DecodeConfig: ...

    def prompt_ids(self, prompt: Prompt, opts: GenerationOptions) -> torch.Tensor: ...

    def decode_on(
        self, slot: Slot, prompt: Prompt, opts: GenerationOptions, stream: bool
    ) -> Generator[Request | str, torch.Tensor | None, GenerationResult]: ...


def _options(
    decoder: Decoder, n: int, shared: Mapping[str, Any], per_prompt: Sequence[Mapping[str, Any]] | None
) -> list[GenerationOptions]:
    """Each prompt's options (the shared ones, then its own), checked and settled before any decoding."""
    if per_prompt is not None and len(per_prompt) != n:
        raise MarspecError(f"per_prompt has {len(per_prompt)} entries for {n} prompts: give one per prompt")
    options = [GenerationOptions.of({**shared, **(per_prompt[i] if per_prompt else {})}) for i in range(n)]
    for opts in options:
        decoder.settle(opts)
    return options


class BatchStream:
    """Iterate to receive ``(prompt index, text delta)`` pairs as the prompts are decoded together;
    ``results`` (one :class:`~marspec.api.GenerationResult` per prompt, in order) is set once iteration
    ends. Closing it early stops every sequence where it waits for a forward."""

    def __init__(self, gen: Generator[tuple[int, str], None, list[GenerationResult]]) -> None:
        self._gen = gen
        self.results: list[GenerationResult] | None = None

    def __iter__(self) -> Iterator[tuple[int, str]]:
        self.results = yield from self._gen

    def close(self) -> None:
        self._gen.close()


def decode_many(
    decoder: Decoder,
    prompts: Sequence[Prompt],
    *,
    max_batch: int | None,
    per_prompt: Sequence[Mapping[str, Any]] | None,
    stream: bool,
    **shared: Any,
) -> Generator[tuple[int, str], None, list[GenerationResult]]:
    """Decode ``prompts`` side by side, at most ``max_batch`` at a time; yield text deltas by prompt
    (when ``stream``) and return the results in prompt order. Options and prompts are checked first."""
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
        raise MarspecError("prompts must be a list of prompts (texts, or chat message lists)")
    batch = settle_max_batch(decoder.target, max_batch)
    options = _options(decoder, len(prompts), shared, per_prompt)
    for prompt, opts in zip(prompts, options, strict=True):
        decoder.prompt_ids(prompt, opts)  # a prompt that does not fit fails here, before any decoding
    scheduler = Scheduler(
        decoder.target,
        decoder.drafter,
        min(batch, max(1, len(prompts))),
        draft_choice=decoder.draft_choice,
    )
    note = batching_note(decoder.target, scheduler.max_batch)
    if note is not None:
        log.warning("marspec: %s", note)
    events: deque[tuple[int, object]] = deque()  # filled as the scheduler advances the sequences

    def work(index: int, prompt: Prompt, opts: GenerationOptions) -> Work:
        def run(slot: Slot) -> Generator[Request, torch.Tensor, None]:
            def text(delta: str) -> bool:
                events.append((index, delta))
                return True

            try:
                result = yield from relay(decoder.decode_on(slot, prompt, opts, stream), text)
            except GeneratorExit:
                raise
            except BaseException as exc:  # raised in the caller's thread
                events.append((index, exc))
            else:
                events.append((index, result))

        return run

    for i, (prompt, opts) in enumerate(zip(prompts, options, strict=True)):
        scheduler.add(work(i, prompt, opts))
    results: list[Any] = [None] * len(prompts)
    left = len(prompts)
    try:
        while left:
            if not events:
                if not scheduler.step():
                    raise RuntimeError("the batch ended with prompts unanswered")  # a bug in a work
                continue
            index, value = events.popleft()
            if isinstance(value, BaseException):
                raise value
            if isinstance(value, str):
                yield index, value
            else:
                results[index] = value
                left -= 1
    finally:
        scheduler.close()
    return results


def relay(
    generation: Generator[Request | str, torch.Tensor | None, GenerationResult],
    text: Callable[[str], bool],
) -> Generator[Request, torch.Tensor, GenerationResult | None]:
    """``generation`` on a batch's slot: its forwards asked of the scheduler, each text delta handed to
    ``text``, which says whether to go on. Returns its result, or None where ``text`` stopped it (it is
    closed then, between two steps, as when a caller closes a stream)."""
    reply: torch.Tensor | None = None
    try:
        while True:
            try:
                item = generation.send(reply)
            except StopIteration as done:
                return done.value
            if isinstance(item, str):
                reply = None
                if not text(item):
                    return None
            else:
                reply = yield item
    finally:
        generation.close()
