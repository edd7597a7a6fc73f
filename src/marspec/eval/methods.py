"""The decoding methods a benchmark compares: marspec's own rules and transformers' peers.

A method name is ``plain``, ``strict``, ``block`` (block verification), ``mars`` (at the run's theta and
margin), ``mars@0.95`` (an explicit theta, the run's margin), ``mars-ratio@0.95`` / ``mars-prob@0.5`` /
``mars-gap@2`` (an explicit margin, logit_ratio / prob_ratio / logit_gap, and its theta), any of the
marspec methods with ``+tree`` (token-tree drafting with the run's tree shape), MARS's with ``+next`` and
MARS's and the rivals' with ``+class`` (the guards), the rival lossy rules ``typical@EPS``, ``pthresh@P``,
``topk@K``, ``fly@ENTROPY``, ``fly-wN@ENTROPY`` (FLy with a window of N; :mod:`marspec.verify.relax`) and
``ensemble@WEIGHT``, ``hf-assisted`` (transformers ``generate(assistant_model=draft)``) or
``hf-prompt-lookup`` (transformers ``generate(prompt_lookup_num_tokens=k)``). All run on the same loaded
models, greedily or all at the run's temperature with the same seed per question and sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from marspec.api import Decoder
from marspec.backends.hf import HFCausalLM
from marspec.errors import MarspecError
from marspec.eval.method_names import METHOD_HELP, RUN_MARS
from marspec.rules import GUARDED_RULES, LOSSLESS_RULES, RIVALS, RULES, Guard, Margin, Rule, rule_family
from marspec.settings import settle_rule
from marspec.stats import GenerationStats

PEERS = ("hf-assisted", "hf-prompt-lookup")
# mars-<short>@THETA names the margin explicitly, so one run can compare margins.
MARGIN_KINDS = {
    "mars-ratio": Margin.LOGIT_RATIO,
    "mars-prob": Margin.PROB_RATIO,
    "mars-gap": Margin.LOGIT_GAP,
}
SUFFIXES = ("tree", "next", "class")


def _window_of(name: str, kind: str) -> int:
    try:
        return int(kind.removeprefix("fly-w"))
    except ValueError:
        raise MarspecError(f"method {name!r}: write FLy's window as fly-wN@THETA, N an integer") from None


@dataclass(frozen=True)
class Method:
    """A parsed method name."""

    name: str  # as given, e.g. "mars@0.95"
    kind: str  # plain | strict | mars | typical | pthresh | topk | hf-assisted | hf-prompt-lookup
    theta: float | None = None  # mars's theta, or a rival rule's parameter
    tree: bool = False  # a marspec rule with token-tree drafting
    margin: Margin | None = None  # mars only: None takes the run's margin
    guard: Guard = Guard.NONE  # "next" (MARS only) or "class", with the +next / +class suffix
    window: int | None = None  # fly only: fly-wN@THETA; None takes FLy's default

    @property
    def needs_draft_model(self) -> bool:
        return self.kind in (*RULES, "hf-assisted")

    @property
    def calibrates(self) -> bool:
        """A setting of the rule whose theta="auto" a calibration stores (MARS's)."""
        return self.kind in RULES and rule_family(self.kind).calibrates


def parse_methods(
    spec: str, theta: float, auto: Rule | None = None, margin: str | None = None
) -> list[Method]:
    """``"plain,strict,mars"`` -> methods; ``mars`` takes the run's ``theta`` and ``margin`` (None: the
    library's default margin, as :class:`~marspec.api.GenerationOptions` resolves it); ``mars@auto``
    takes the margin and theta of ``auto`` (the pair's calibration), which must then be given."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise MarspecError(f"no methods given: pass a comma-separated list of {METHOD_HELP}")
    methods = []
    for name in names:
        base, plus, suffix = name.partition("+")
        if plus and suffix not in SUFFIXES:
            raise MarspecError(
                f"unknown method {name!r}: the suffixes are {', '.join('+' + s for s in SUFFIXES)}; "
                f"choose from {METHOD_HELP}"
            )
        tree = suffix == "tree"
        guard = Guard(suffix) if suffix in ("next", "class") else Guard.NONE
        kind, _, arg = base.partition("@")
        window = None
        if kind.startswith("fly-w"):  # fly-wN@THETA: FLy with a window of N
            kind, window = "fly", _window_of(name, kind)
        # Which rules a guard narrows is marspec.rules' to say; here it is refused by the method's name.
        rule_kind = RUN_MARS if kind in MARGIN_KINDS else kind
        if tree and rule_kind not in RULES:
            raise MarspecError(f"method {name!r}: only marspec's rules can draft a tree")
        if guard is not Guard.NONE and rule_kind not in GUARDED_RULES[guard]:
            takers = "MARS" if guard is Guard.NEXT else "MARS and the rival rules"
            raise MarspecError(f"method {name!r}: only {takers} methods take the +{guard} guard")
        if rule_kind in RULES and rule_family(rule_kind).calibrates:
            if kind in MARGIN_KINDS and not arg:
                raise MarspecError(f"method {name!r} needs its theta: write it as {kind}@THETA")
            if arg == "auto" and kind not in MARGIN_KINDS:
                if auto is None:
                    raise MarspecError(f"method {name!r} needs the pair's calibration (marspec calibrate)")
                methods.append(Method(name, rule_kind, auto.theta, tree, auto.margin, guard))
                continue
            value = theta
            if arg:
                try:
                    value = float(arg)
                except ValueError:
                    raise MarspecError(f"method {name!r}: theta after '@' must be a number") from None
            named = MARGIN_KINDS.get(kind)
            # Validated against the margin it will run with: its own, else the run's, else the library's
            # default (settle_rule fills None, the one place defaults are filled).
            settle_rule(rule_kind, value, named or margin, guard)
            methods.append(Method(name, rule_kind, value, tree, named, guard))
        elif kind in RIVALS:
            if not arg:
                raise MarspecError(f"method {name!r} needs its parameter: write it as {kind}@VALUE")
            try:
                value = float(arg)
            except ValueError:
                raise MarspecError(f"method {name!r}: the parameter after '@' must be a number") from None
            rule = settle_rule(kind, value, guard=guard, window=window)
            if tree:
                rule.check_tree()
            methods.append(Method(name, kind, value, tree, guard=guard, window=window))
        elif arg or kind not in (*LOSSLESS_RULES, *PEERS):  # a lossless rule takes no parameter
            raise MarspecError(f"unknown method {name!r}: choose from {METHOD_HELP}")
        else:
            methods.append(Method(name, kind, tree=tree))
    if len({m.name for m in methods}) != len(methods):
        raise MarspecError(f"a method is listed twice in {spec!r}")
    return methods


@dataclass
class TurnOutput:
    """One generated turn and its measurements."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    hit_limit: bool
    seed: int | None = None  # the sampling seed (None: greedy)
    # Each relaxed token as [position in token_ids, token, the target's top-1 it replaced, margin].
    relaxed: list[list[float]] = field(default_factory=list)


def run_method(
    decoder: Decoder,
    method: Method,
    messages: list[dict[str, str]],
    *,
    k: int,
    max_new_tokens: int,
    margin: str | None = None,
    tree: tuple[int, ...] | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    reuse_prefix: bool = False,
) -> TurnOutput:
    """Generate one assistant turn for ``messages`` with ``method`` (``tree``: the shape a ``+tree``
    method drafts; ``seed`` makes a sampled turn reproducible; ``reuse_prefix``: keep the cache of the
    conversation so far, for marspec's own methods; transformers' peers always score the whole prompt)."""
    if method.kind in PEERS:
        return _run_hf_peer(
            decoder, method, messages, k=k, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
        )
    options: dict[str, Any] = {
        "rule": method.kind,
        "k": k,
        "max_new_tokens": max_new_tokens,
        "margin": method.margin or margin,
        "temperature": temperature,
        "seed": seed,
        "guard": method.guard,
        "reuse_prefix": reuse_prefix,
    }
    if method.window is not None:
        options["window"] = method.window
    if method.theta is not None:
        options["theta"] = method.theta
    if method.tree:
        if tree is None:
            raise MarspecError(f"method {method.name!r} needs a tree shape: pass --tree, e.g. --tree 2,2")
        options["tree"] = tree
    result = decoder.generate(messages, **options)
    relaxed = [
        [pos, result.token_ids[pos], top1, round(margin, 4)]
        for pos, top1, margin in zip(
            result.relaxed_positions, result.relaxed_top1, result.relaxed_margins, strict=True
        )
    ]
    hit_limit = result.finish_reason == "length"
    return TurnOutput(result.text, result.token_ids, result.stats, hit_limit, seed, relaxed)


class _ForwardCounter:
    """Counts and times calls of a module's forward (transformers' generate gives neither)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._start = 0.0
        self._handles = (
            module.register_forward_pre_hook(self._pre),
            module.register_forward_hook(self._post),
        )

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _run_hf_peer(
    decoder: Decoder,
    method: Method,
    messages: list[dict[str, str]],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
) -> TurnOutput:
    from marspec.prompting import encode_prompt

    target = decoder.target
    prompt_ids = encode_prompt(target.tokenizer, messages, True, target.name).to(target.device)
    eos = sorted(decoder.eos_token_ids)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        # The target's own distribution at this temperature, as marspec samples it: no top-k/top-p
        # truncation or penalties (a model's generation_config may carry some).
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": None}
        sampling["repetition_penalty"] = 1.0
    config = GenerationConfig(
        **sampling,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0],
    )
    kwargs: dict[str, Any] = {}
    draft_model = None
    if method.kind == "hf-assisted":
        draft_lm = decoder.drafter.draft_model if decoder.drafter else None
        if not isinstance(draft_lm, HFCausalLM):
            raise MarspecError(
                "hf-assisted needs a transformers draft model: run the benchmark with --draft NAME"
            )
        draft_model = draft_lm.model
        kwargs["assistant_model"] = draft_model
    else:
        config.prompt_lookup_num_tokens = k

    counter = _ForwardCounter(target.model)
    draft_counter = _ForwardCounter(draft_model) if draft_model is not None else None
    if temperature > 0 and seed is not None:
        torch.manual_seed(seed)  # transformers samples from torch's global generator
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=prompt_ids[None],
                attention_mask=torch.ones_like(prompt_ids)[None],
                generation_config=config,
                **kwargs,
            )
    finally:
        counter.remove()
        if draft_counter is not None:
            draft_counter.remove()
    wall = time.perf_counter() - start

    new = out[0, prompt_ids.shape[0] :].tolist()
    finished = False
    for i, tok in enumerate(new):
        if tok in decoder.eos_token_ids:
            new, finished = new[:i], True
            break
    stats = GenerationStats(
        new_tokens=len(new),
        prompt_tokens=int(prompt_ids.shape[0]),
        target_forwards=counter.calls,
        stopped_at_eos=finished,
        wall_s=wall,
        target_forward_s=counter.seconds,
        draft_forward_s=draft_counter.seconds if draft_counter else 0.0,
    )
    text = target.tokenizer.decode(new, skip_special_tokens=True)
    hit_limit = not finished and len(new) >= max_new_tokens
    return TurnOutput(text, new, stats, hit_limit, seed if temperature > 0 else None)
