"""The one decode loop: plain autoregressive decoding is speculative decoding with an empty draft.

Cache discipline: the target's cache always holds every committed token except the newest one (the
"pending" token). A step scores ``[pending] + draft`` in one forward, so row i of the logits predicts the
token after ``draft[i-1]`` (row 0 verifies draft[0]; the last row is the bonus position). After
verification both caches are rolled back in place to the accepted prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from marspec.defaults import MAX_K, MAX_TOP_LOGPROBS
from marspec.drafters.tree import build_tree
from marspec.errors import MarspecError
from marspec.forward_requests import Forward, Request, TreeForward, propose, solo
from marspec.interfaces import CausalLM, Draft, Drafter, DraftTree, TreeDrafter
from marspec.rules import Rule
from marspec.stats import GenerationStats, StepRecord
from marspec.thinking import ThinkingMarkers, ThinkingSpan
from marspec.verify.chain import Verification, to_host
from marspec.verify.greedy import verify_greedy
from marspec.verify.sampling import verify_sampling
from marspec.verify.tree import TreeVerification, verify_tree_greedy


@dataclass(frozen=True)
class DecodeConfig:
    """What the loop needs besides the models, complete: :func:`marspec.settings.settle` makes one from
    a user's options (and fills what they leave unset); here values are checked, never filled in. The
    fields after ``max_new_tokens`` default to the loop's plain behaviour (greedy, a fixed draft length,
    no EOS, a chain, prefix reuse on)."""

    rule: Rule
    k: int  # most draft tokens per step
    max_new_tokens: int
    # Grow the draft length by 2 after a step that accepted its whole draft, shrink it by 1 after a
    # rejection, within [1, k] (the schedule transformers' assisted generation uses). Off: always k.
    adaptive_k: bool = False
    temperature: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    # Token-tree drafting: candidates per depth (marspec.drafters.tree.parse_tree_shape), e.g. (3, 2)
    # scores the draft's two runner-ups as extra leaves at depth 1 and one at depth 2, all in the one
    # verification forward. None: a plain chain.
    tree: tuple[int, ...] | None = None
    # Keep the cached prefix a new prompt shares with the previous sequence (multi-turn chat) instead of
    # scoring it again. Off: every prompt is scored from scratch.
    reuse_prefix: bool = True
    # The "class" guard's table, bool[V]: the token ids it may relax (marspec.token_classes), built once
    # per tokenizer by the pair (marspec.settings.Pair); None for every other guard.
    relaxable: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # The "thinking" guard's span markers (marspec.thinking), read from the tokenizer or given per
    # request; None for every other guard.
    thinking: ThinkingMarkers | None = None
    # Read each emitted token's log probability under the target (temperature 1) and its top-N
    # alternatives from the verification logits; None: not read (no work, no extra host copy).
    logprobs: int | None = None

    @property
    def drafts_leave_output(self) -> bool:
        """Whether the tokens decoded are the same whatever is drafted: greedy under a lossless rule, each
        emitted token the target's top choice (on an engine whose rows are scored alone, bit for bit), so
        the draft length may change from step to step without changing the answer."""
        return self.temperature == 0 and self.rule.name.lossless

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise MarspecError(f"k (draft length) must be an integer in [1, {MAX_K}], got {self.k!r}")
        if not isinstance(self.adaptive_k, bool):
            raise MarspecError(f"adaptive_k must be true or false, got {self.adaptive_k!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise MarspecError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise MarspecError(
                f"temperature must be >= 0 (0 = greedy, > 0 = sampling), got {self.temperature}"
            )
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise MarspecError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.tree is not None:
            if not (isinstance(self.tree, tuple) and all(isinstance(w, int) and w >= 1 for w in self.tree)):
                raise MarspecError(
                    f"tree must be a shape tuple such as (3, 2), got {self.tree!r}: parse a written shape "
                    "with marspec.drafters.tree.parse_tree_shape"
                )
            self.rule.check_tree()  # the rule knows whether it can judge a tree (marspec.rules)
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise MarspecError(
                f"logprobs must be None (off) or the number of alternatives to list per token, an integer "
                f"in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}",
                field="logprobs",
            )
        if not isinstance(self.reuse_prefix, bool):
            raise MarspecError(f"reuse_prefix must be true or false, got {self.reuse_prefix!r}")
        if self.tree is not None and self.temperature > 0:
            raise MarspecError(
                "tree drafting verifies greedily only (temperature 0); use temperature=0 or drop the tree"
            )


@dataclass(frozen=True)
class Step:
    """What one verification step committed, and how the rule judged its draft.

    ``relaxed_at`` is the one encoding of where relaxed tokens are: draft positions, which are also
    indices into ``tokens`` (an accepted draft token is committed where it was drafted). A relaxed
    accept the text ended at (an EOS) is judged but not committed, so a position may equal
    ``len(tokens)``; ``relaxed_top1`` and ``relaxed_margins`` are aligned with ``relaxed_at``.
    """

    tokens: list[int]  # committed: the accepted drafts and the correction or bonus, cut at an EOS
    finished: bool  # an EOS ended the text
    relaxed_at: tuple[int, ...] = ()
    relaxed_top1: tuple[int, ...] = ()  # the target's top-1 each relaxed token replaced
    relaxed_margins: tuple[float, ...] = ()  # the rule's margin there
    drafted: int = 0  # draft tokens scored (0 for plain decoding)
    siblings: int = 0  # extra tree nodes scored beside the chain
    accepted: int = 0  # draft tokens the rule accepted
    judged: int = 0  # accepted drafts the text goes on from (those after an accepted EOS are not)
    margins: tuple[float, ...] = ()  # the rule's margin at each draft position it judged
    # With DecodeConfig.logprobs: each committed token's log probability under the target (temperature
    # 1), and the target's top-N (token, log probability) there, most likely first; aligned with tokens.
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()

    @property
    def committed_relaxed(self) -> list[int]:
        """The indices of ``relaxed_at`` that point into ``tokens`` (the relaxed tokens returned)."""
        return [i for i, position in enumerate(self.relaxed_at) if position < len(self.tokens)]


def decode(
    target: CausalLM,
    drafter: Drafter | None,
    prompt_ids: torch.Tensor,
    config: DecodeConfig,
    stats: GenerationStats,
    generator: torch.Generator | None = None,
    draft_cap: Callable[[], int] | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt_ids`` (long[L], L >= 1), yielding each verification step's new tokens:
    :func:`decode_steps` with its forwards run at once (one sequence on its own). The caller may stop
    iterating at any time (stop strings, cancellation)."""
    return solo(decode_steps(target, drafter, prompt_ids, config, stats, generator, draft_cap))


def decode_steps(
    target: CausalLM,
    drafter: Drafter | None,
    prompt_ids: torch.Tensor,
    config: DecodeConfig,
    stats: GenerationStats,
    generator: torch.Generator | None = None,
    draft_cap: Callable[[], int] | None = None,
) -> Generator[Request | Step, torch.Tensor | None, None]:
    """The one decode loop, as a generator: it yields each model forward it needs
    (:mod:`marspec.forward_requests`; send back the logits) and each verification step's :class:`Step`
    (send back None), so that one thread can drive many sequences at once (:mod:`marspec.batch`).

    ``stats`` is filled in as the loop runs, from what each step yields; timings of model forwards are
    read from the backends. ``draft_cap``, read at each step, bounds that step's draft length below
    ``config.k`` (a batch that shortens drafts as it grows); give one only where
    ``config.drafts_leave_output``.
    """
    prompt_len = int(prompt_ids.shape[0])
    budget = config.max_new_tokens
    if target.context_length:
        budget = min(budget, target.context_length - prompt_len)
    # The committed tokens, on the target's device (the drafter and verification read slices of it).
    seq = torch.empty(prompt_len + budget + config.k + 1, dtype=torch.long, device=target.device)
    seq[:prompt_len] = prompt_ids
    # Both caches hold at most the prompt but its last token, which the first step scores.
    reused = _start_sequence(target, drafter, seq[: prompt_len - 1], config.reuse_prefix)
    clocks = _Clocks(target, drafter)
    clocks.unread_prefill = reused < prompt_len - 1  # a prefill whose time is read after the first step
    if clocks.unread_prefill:
        yield Forward(target, seq[reused : prompt_len - 1], last_only=True)
    stats.prompt_tokens = prompt_len
    stats.reused_tokens = reused
    yield from _steps(target, drafter, seq, prompt_len, budget, config, generator, draft_cap, stats, clocks)


def _steps(
    target: CausalLM,
    drafter: Drafter | None,
    seq: torch.Tensor,
    length: int,
    budget: int,
    config: DecodeConfig,
    generator: torch.Generator | None,
    draft_cap: Callable[[], int] | None,
    stats: GenerationStats,
    clocks: _Clocks,
) -> Generator[Request | Step, torch.Tensor | None, None]:
    """The loop itself: each step proposes, scores and verifies a draft, commits what was accepted and
    rolls both caches back to it. ``seq[:length]`` is the context; the target's cache holds all of it
    but its last token (the "pending" one, which each step scores first)."""
    produced, draft_len = 0, config.k
    alternatives = max(config.tree) - 1 if config.tree else 0
    # The ensemble reads the draft's distribution, which a greedy drafter otherwise does not return.
    wants_q = config.rule.family.needs_draft_probs
    markers = config.thinking
    thinking = markers is not None and markers.open_after(seq[:length].tolist())
    while produced < budget:
        # Propose. One token always comes from the target (correction or bonus): never draft past the
        # budget. Drafts go where they would be committed, so accepted ones need no copy later.
        k = min(draft_len, budget - produced - 1)
        if draft_cap is not None:
            k = min(k, draft_cap())
        tree: DraftTree | None = None
        if drafter is not None and k > 0 and config.tree and isinstance(drafter, TreeDrafter):
            draft, tree = drafter.propose_tree(seq[:length], k, config.tree)
        elif drafter is not None and k > 0:
            draft = yield from propose(
                drafter, seq[:length], k, config.temperature, generator, alternatives, wants_q
            )
            tree = build_tree(draft, config.tree) if config.tree and draft.alternatives is not None else None
        else:
            draft = Draft(tokens=seq.new_empty(0))
        n_draft = len(draft)
        if n_draft:
            seq[length : length + n_draft] = draft.tokens
        # Score and verify: one target forward, one host read (inside the verifier).
        span = None if markers is None else markers.span(draft.tokens, thinking)
        if tree is not None:
            logits = yield TreeForward(target, tree, seq[length - 1 : length])  # [1 + nodes, V]
        else:
            logits = yield Forward(target, seq[length - 1 : length + n_draft])  # [1 + k, V]
        assert logits is not None
        verdict = _verify(logits, draft, tree, config, generator, span)
        tokens, judged, finished = _cut_at_eos(verdict, config.eos_token_ids)
        thinking = markers is not None and markers.open_after(tokens, thinking)
        # Commit: accepted chain drafts are in place; the correction or bonus token, and a sibling a
        # tree's path ends in, are written from the verdict's host values (a scalar fill each).
        placed = verdict.chain_prefix if isinstance(verdict, TreeVerification) else verdict.n_accepted
        for i in range(placed, len(tokens)):
            seq[length + i] = tokens[i]
        read = _NO_LOGPROBS
        if config.logprobs is not None and tokens:
            rows = [0, *verdict.path] if isinstance(verdict, TreeVerification) else None
            read = _token_logprobs(logits, rows, seq[length : length + len(tokens)], config.logprobs)
        # Roll back both caches to the accepted prefix; the newest token stays pending.
        if isinstance(verdict, TreeVerification):
            target.keep_path(length - 1, verdict.path)
            draft_valid = length + verdict.chain_prefix  # the draft cache holds the chain, not siblings
        else:
            target.rollback(length + verdict.n_accepted)
            draft_valid = length + verdict.n_accepted
        length += len(tokens)
        produced += len(tokens)
        if drafter is not None:
            drafter.rollback(min(length - 1, draft_valid))
        if config.adaptive_k and n_draft:
            draft_len = _next_draft_len(draft_len, verdict.n_accepted == n_draft, config.k)
        siblings = len(tree) - n_draft if tree else 0
        step = _step(verdict, tokens, finished, judged, n_draft, siblings, read)
        clocks.note(stats, step)
        yield step
        if finished:
            return


def _verify(
    logits: torch.Tensor,
    draft: Draft,
    tree: DraftTree | None,
    config: DecodeConfig,
    generator: torch.Generator | None,
    span: ThinkingSpan | None = None,
) -> Verification:
    """The rule's verdict on the target's ``logits`` over ``[pending] + draft`` (a chain, or a tree's
    nodes). Row i of the logits predicts the token after ``draft[i-1]``: row 0 verifies draft[0], the
    last row is the bonus position."""
    if tree is not None:
        return verify_tree_greedy(logits, tree, config.rule, config.relaxable)
    if config.temperature > 0:
        return verify_sampling(
            logits,
            draft.tokens,
            draft.probs,
            config.rule,
            config.temperature,
            generator,
            config.relaxable,
            span,
        )
    return verify_greedy(logits, draft.tokens, config.rule, config.relaxable, draft.probs, span)


_TokenLogprobs = tuple[tuple[float, ...], tuple[tuple[tuple[int, float], ...], ...]]
_NO_LOGPROBS: _TokenLogprobs = ((), ())


def _token_logprobs(
    logits: torch.Tensor, rows: list[int] | None, tokens: torch.Tensor, top: int
) -> _TokenLogprobs:
    """The committed ``tokens``' log probabilities under the target at temperature 1 and its ``top``
    most likely tokens at each, read from the verification ``logits`` in one device-to-host copy.

    Row ``rows[i]`` of ``logits`` is the distribution token ``i`` was emitted from: for a chain the
    first rows in order (None), for a tree the root's and then each accepted path node's. Only the
    emitted rows are normalised."""
    n = tokens.shape[0]
    if rows is None:
        emitted = logits[:n]
    else:
        emitted = logits.index_select(0, torch.tensor(rows[:n], device=logits.device))
    logp = torch.log_softmax(emitted.float(), dim=-1)  # [n, V]
    chosen = logp.gather(1, tokens.view(n, 1).to(logits.device))[:, 0]  # [n]
    top_values, top_ids = logp.topk(top, dim=-1)  # [n, top], most likely first
    chosen_h, values_h, ids_h = to_host(chosen, top_values, top_ids)
    values_rows, ids_rows = values_h.view(n, top).tolist(), ids_h.view(n, top).long().tolist()
    alternatives = tuple(
        tuple(zip(ids, values, strict=True)) for ids, values in zip(ids_rows, values_rows, strict=True)
    )
    return tuple(chosen_h.tolist()), alternatives


def _cut_at_eos(verdict: Verification, eos_token_ids: frozenset[int]) -> tuple[list[int], int, bool]:
    """The tokens the step commits (the accepted drafts and the correction or bonus, up to an EOS), how
    many accepted drafts were judged (drafts after an accepted EOS never count: the text ended) and
    whether an EOS ended the text. The budget needs no cut: the loop drafts at most one token fewer
    than it has left."""
    tokens = verdict.emitted()
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[:i], min(verdict.n_accepted, i + 1), True
    return tokens, verdict.n_accepted, False


def _next_draft_len(draft_len: int, all_accepted: bool, k: int) -> int:
    """transformers' schedule: grow by 2 after a fully accepted draft, shrink by 1 after a rejection."""
    return min(k, draft_len + 2) if all_accepted else max(1, draft_len - 1)


def _step(
    verdict: Verification,
    tokens: list[int],
    finished: bool,
    judged: int,
    drafted: int,
    siblings: int,
    read: _TokenLogprobs = _NO_LOGPROBS,
) -> Step:
    """The step as Python values, from the verdict the verifier already read back to the host in the
    step's one copy, and the log probabilities ``read`` in their own when asked for (nothing here waits
    on a device)."""
    relaxed_at = tuple(i for i, flag in enumerate(verdict.relaxed.tolist()) if flag)
    top1 = verdict.top1.tolist() if verdict.top1 is not None and relaxed_at else []
    margins = tuple(verdict.margins.tolist())
    return Step(
        tokens=tokens,
        finished=finished,
        relaxed_at=relaxed_at,
        relaxed_top1=tuple(top1[i] for i in relaxed_at),
        relaxed_margins=tuple(margins[i] for i in relaxed_at),
        drafted=drafted,
        siblings=siblings,
        accepted=verdict.n_accepted,
        judged=judged,
        margins=margins,
        logprobs=read[0],
        top_logprobs=read[1],
    )


def _record(step: Step) -> StepRecord:
    """The statistics of a step (acceptance accounting), derived from what it yielded."""
    ended_in_draft = step.judged < step.accepted  # an accepted EOS ended the text inside the draft
    judged_relaxed = tuple(p for p in step.relaxed_at if p < step.judged)
    return StepRecord(
        drafted=step.drafted,
        siblings=step.siblings,
        accepted_exact=step.judged - len(judged_relaxed),
        accepted_relaxed=len(judged_relaxed),
        rejected=step.accepted < step.drafted and not ended_in_draft,
        emitted=len(step.tokens),
        margins=step.margins[: step.judged] if ended_in_draft else step.margins,
        relaxed_at=judged_relaxed,
        unjudged=step.drafted - step.judged if ended_in_draft else 0,
    )


class _Clocks:
    """The backends' forward clocks at the start of a generation, read into its statistics."""

    def __init__(self, target: CausalLM, drafter: Drafter | None) -> None:
        self.target = target
        self.draft_lm = drafter.draft_model if drafter is not None else None
        self.target_s0 = target.clock.seconds
        self.draft_s0 = self.draft_lm.clock.seconds if self.draft_lm else 0.0
        self.draft_calls0 = self.draft_lm.clock.calls if self.draft_lm else 0
        self.unread_prefill = False  # whether a prefill ran whose time the first step's read takes

    def note(self, stats: GenerationStats, step: Step) -> None:
        """``step`` recorded in ``stats``, and the forward clocks read into it."""
        stats.record(_record(step))
        stats.new_tokens += len(step.tokens)
        stats.stopped_at_eos = step.finished
        self.read(stats, prefill=self.unread_prefill)
        self.unread_prefill = False

    def read(self, stats: GenerationStats, prefill: bool) -> None:
        stats.target_forward_s = self.target.clock.seconds - self.target_s0
        if prefill:
            # Read after the first step, not right after the prefill: on an accelerator that read would
            # wait for the device. The target's forwards since are this step's verification, the last.
            stats.prefill_s = stats.target_forward_s - self.target.clock.last
        if self.draft_lm is not None:
            stats.draft_forward_s = self.draft_lm.clock.seconds - self.draft_s0
            stats.draft_forwards = self.draft_lm.clock.calls - self.draft_calls0


def _start_sequence(
    target: CausalLM, drafter: Drafter | None, cached_prompt: torch.Tensor, reuse: bool
) -> int:
    """Ready both caches for a new sequence whose cache should hold ``cached_prompt`` (long[L - 1]):
    keep what each already holds of it when ``reuse``, else start empty. Returns the target's kept
    positions (the draft model catches up on its own: it scores the context it has not seen)."""
    if not reuse:
        target.reset()
        if drafter is not None:
            drafter.reset()
        return 0
    kept = target.keep_prefix(cached_prompt)
    if drafter is not None:
        if drafter.draft_model is None:
            drafter.reset()
        else:
            drafter.rollback(drafter.draft_model.keep_prefix(cached_prompt))
    return kept
