"""One device read per step: host reads of device tensors counted while the loop runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from marspec.api import Decoder
    from marspec.backends.hf import HFCausalLM
    from marspec.stats import GenerationStats

from marspec.selftest.equality import NEW_TOKENS, PROMPTS, TREE, K
from marspec.selftest.report import Check


class _StandIn(torch.Tensor):
    """A CPU tensor standing for one on an accelerator; what is computed from it stays a stand-in."""


# Calls that read a tensor's values on the host: on an accelerator each waits for the device.
_READS = frozenset(
    {"cpu", "numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__complex__"}
    | {"__format__", "equal", "allclose", "is_nonzero"}
    # Results whose shape depends on the values: the host must read them to size the output.
    | {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors for which ``on_device`` holds, while active. A copy to the host made
    here (``.cpu()``, ``.to("cpu")``) is a plain host tensor, free to read."""

    def __init__(self, on_device: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.on_device = on_device
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = name in ("cpu", "to", "copy_") and _to_host(name, args, kwargs)
        if name == "copy_":  # dst.copy_(src): the source is what is read
            src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            read = to_host and src is not None and self.on_device(src)
        else:
            read = source is not None and self.on_device(source) and (name in _READS or to_host)
        if read:
            self.reads.append(name)
        out = func(*args, **kwargs)
        if to_host and isinstance(out, _StandIn):
            out = out.as_subclass(torch.Tensor)
        return out


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a ``cpu``/``to``/``copy_`` call puts data on the host."""
    if name == "cpu":
        return True
    if name == "copy_":  # dst.copy_(src): a read of src when dst is a host tensor
        return len(args) > 1 and args[0].device.type == "cpu"
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    if isinstance(target, torch.Tensor):
        target = target.device
    return target is not None and torch.device(target).type == "cpu"


@contextlib.contextmanager
def _stand_in_outputs(*lms: HFCausalLM) -> Iterator[None]:
    """Make the models' forwards return stand-ins for device tensors (CPU only), then undo it."""
    for lm in lms:
        for method in ("forward", "forward_tree"):
            original = getattr(lm, method)
            setattr(lm, method, lambda *a, _f=original, **kw: _f(*a, **kw).as_subclass(_StandIn))
    try:
        yield
    finally:
        for lm in lms:
            del lm.forward, lm.forward_tree  # the instance attributes: the class's methods show again


def reads_per_step(
    decoder: Decoder, prompt: torch.Tensor, stats: GenerationStats | None = None, **config: Any
) -> list[int]:
    """Host reads of device tensors in each step of one decode with ``DecodeConfig(**config)``; the
    decode's counts go to ``stats`` when given."""
    from marspec.decode import DecodeConfig, decode
    from marspec.stats import GenerationStats

    target, drafter = decoder.target, decoder.drafter
    lms = [target] + ([drafter.draft_model] if drafter is not None and drafter.draft_model else [])
    device = target.device
    if device.type == "cpu":
        on_device: Callable[[torch.Tensor], bool] = lambda t: isinstance(t, _StandIn)  # noqa: E731
        stand_in = _stand_in_outputs(*lms)
    else:
        on_device = lambda t: t.device.type == device.type  # noqa: E731
        stand_in = contextlib.nullcontext()
    generator = torch.Generator(device=device).manual_seed(0)
    stats = GenerationStats() if stats is None else stats
    steps = decode(target, drafter, prompt, DecodeConfig(**config), stats, generator)
    counts = []
    with stand_in:
        while True:
            with HostReads(on_device) as reads:
                step = next(steps, None)
            if step is None:
                return counts
            counts.append(len(reads.reads))


def one_read_per_step(decoder: Decoder) -> Check:
    """Every verification step reads the device exactly once, whichever rule, regime or draft shape."""
    from marspec.defaults import GUARD_CLASSES
    from marspec.drafters.tree import parse_tree_shape
    from marspec.rules import Rule
    from marspec.stats import GenerationStats
    from marspec.token_classes import relaxable_table

    name = "one device read per step"
    device = decoder.target.device
    prompts = [decoder.tokenizer(p, return_tensors="pt")["input_ids"][0].to(device) for p in PROMPTS]
    # The class guard's table, on the target's device as Decoder.generate puts it. The tiny random model's
    # close calls fall on letters, which the default classes refuse: "word" is added so the guard lets
    # some through and the relaxed path runs (the guard's choices are tests/test_class_guard.py's job).
    classes = (*GUARD_CLASSES, "word")
    table = relaxable_table(decoder.tokenizer, decoder.target.vocab_size, classes).to(device)
    regimes = {
        "strict": {"rule": Rule(name="strict")},
        "mars": {"rule": Rule(name="mars", theta=0.3, margin="prob_ratio")},
        "mars+class": {
            "rule": Rule(name="mars", theta=0.0, margin="prob_ratio", guard="class"),
            "relaxable": table,
        },
        # A window shorter than the draft, so FLy's deferral (which reads the tokens after a mismatch) runs.
        "fly": {"rule": Rule(name="fly", theta=0.0, window=1)},
        "sampling": {"rule": Rule(name="strict"), "temperature": 1.0},
        "tree": {"rule": Rule(name="strict"), "tree": parse_tree_shape(TREE)},
    }
    steps = relaxed = 0
    for label, config in regimes.items():
        stats = GenerationStats()
        counts = []
        for prompt in prompts:
            counts += reads_per_step(
                decoder, prompt, stats, k=K, max_new_tokens=NEW_TOKENS, reuse_prefix=False, **config
            )
        bad = [(i, n) for i, n in enumerate(counts) if n != 1]
        if bad or not counts:
            where = f"step {bad[0][0] + 1} read it {bad[0][1]} times" if bad else "no step ran"
            return Check(name, False, f"{label}: {where} ({len(counts)} steps)")
        if config["rule"].relaxes and not stats.accepted_relaxed:
            # A relaxing rule that never relaxed has not run its relaxation's code: the count says nothing.
            return Check(name, False, f"vacuous: {label} relaxed no draft token ({len(counts)} steps)")
        steps += len(counts)
        relaxed += stats.accepted_relaxed
    return Check(name, True, f"{steps} steps ({', '.join(regimes)}): 1 read each; {relaxed} relaxed tokens")
