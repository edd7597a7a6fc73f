"""The one decode loop: plain autoregressive decoding is speculative decoding with an empty draft.

Cache discipline: the target's cache always holds every committed token except the newest one (the
"pending" token). A step scores ``[pending] + draft`` in one forward, so row i of the logits predicts the
token after ``draft[i-1]`` (row 0 verifies draft[0]; the last row is the bonus position). After
verification both caches are rolled back in place to the accepted prefix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from marspec.defaults import MAX_K
from marspec.drafters.tree import build_tree, parse_tree_shape
from marspec.errors import MarspecError
from marspec.interfaces import CausalLM, Draft, Drafter
from marspec.stats import GenerationStats, StepRecord
from marspec.verify import (
    Rule,
    TreeVerification,
    Verification,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
)

STRICT = Rule(name="strict")


@dataclass(frozen=True)
class DecodeConfig:
    """What the loop needs besides the models. Validated on construction (user input arrives here)."""

    rule: Rule = STRICT
    k: int = 5
    # Grow the draft length by 2 after a step that accepted its whole draft, shrink it by 1 after a
    # rejection, within [1, k] (the schedule transformers' assisted generation uses). Off: always k.
    adaptive_k: bool = False
    temperature: float = 0.0
    max_new_tokens: int = 128
    eos_token_ids: frozenset[int] = frozenset()
    # Token-tree drafting: candidates per depth, e.g. (3, 2) scores the draft's two runner-ups as extra
    # leaves at depth 1 and one at depth 2, all in the one verification forward. None: a plain chain.
    tree: tuple[int, ...] | None = None
    # Keep the cached prefix a new prompt shares with the previous sequence (multi-turn chat) instead of
    # scoring it again. Off: every prompt is scored from scratch.
    reuse_prefix: bool = True
    # The "class" guard's table, bool[V]: the token ids it may relax (marspec.token_classes), built once
    # per tokenizer by the caller (Decoder does); None for every other guard.
    relaxable: torch.Tensor | None = field(default=None, compare=False, repr=False)

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
        object.__setattr__(self, "tree", parse_tree_shape(self.tree))
        if self.tree is not None:
            self.rule.check_tree()  # the rule knows whether it can judge a tree (marspec.rules)
        if not isinstance(self.reuse_prefix, bool):
            raise MarspecError(f"reuse_prefix must be true or false, got {self.reuse_prefix!r}")
        if self.tree is not None and self.temperature > 0:
            raise MarspecError(
                "tree drafting verifies greedily only (temperature 0); use temperature=0 or drop the tree"
            )


@dataclass(frozen=True)
class Step:
    """Tokens a step committed, and which of them were relaxed accepts."""

    tokens: list[int]
    relaxed: list[bool]
    finished: bool  # EOS reached
    # At each relaxed token, in order: the target's top-1 it replaced, and the rule's margin there.
    relaxed_top1: tuple[int, ...] = ()
    relaxed_margins: tuple[float, ...] = ()


def decode(
    target: CausalLM,
    drafter: Drafter | None,
    prompt_ids: torch.Tensor,
    config: DecodeConfig,
    stats: GenerationStats,
    generator: torch.Generator | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt_ids`` (long[L], L >= 1), yielding each verification step's new tokens.

    The caller may stop iterating at any time (stop strings, cancellation). ``stats`` is filled in as
    the loop runs; timings of model forwards are read from the backends.
    """
    prompt_len = int(prompt_ids.shape[0])
    budget = config.max_new_tokens
    if target.context_length:
        budget = min(budget, target.context_length - prompt_len)
    # The committed tokens, on the target's device (the drafter and verification read slices of it).
    seq = torch.empty(prompt_len + budget + config.k + 1, dtype=torch.long, device=target.device)
    seq[:prompt_len] = prompt_ids
    length = prompt_len
    sampling = config.temperature > 0
    draft_lm = drafter.draft_model if drafter is not None else None
    alternatives = max(config.tree) - 1 if config.tree else 0

    # Both caches hold at most the prompt but its last token, which the first step scores.
    reused = _start_sequence(target, drafter, seq[: prompt_len - 1], config.reuse_prefix)
    target_s0 = target.clock.seconds
    draft_s0 = draft_lm.clock.seconds if draft_lm else 0.0
    draft_calls0 = draft_lm.clock.calls if draft_lm else 0
    unread_prefill = reused < prompt_len - 1  # a prefill whose time is read after the first step
    if unread_prefill:
        target.forward(seq[reused : prompt_len - 1], last_only=True)
    stats.prompt_tokens = prompt_len
    stats.reused_tokens = reused

    produced = 0
    draft_len = config.k
    while produced < budget:
        # One token always comes from the target (correction or bonus): never draft past the budget.
        k = min(draft_len, budget - produced - 1)
        if drafter is not None and k > 0:
            draft = drafter.propose(seq[:length], k, config.temperature, generator, alternatives)
        else:
            draft = Draft(tokens=seq.new_empty(0))
        n_draft = len(draft)
        if n_draft:
            # Drafts go where they would be committed: a chain's forward scores a slice of the sequence,
            # and accepted drafts need no copy after the verdict.
            seq[length : length + n_draft] = draft.tokens

        tree = build_tree(draft, config.tree) if config.tree and draft.alternatives is not None else None
        verdict: Verification
        if tree is not None:
            logits = target.forward_tree(tree, seq[length - 1 : length])  # [1 + nodes, V]
            verdict = verify_tree_greedy(logits, tree, config.rule, config.relaxable)
        else:
            logits = target.forward(seq[length - 1 : length + n_draft])  # [1 + k, V]
            if sampling:
                verdict = verify_sampling(
                    logits,
                    draft.tokens,
                    draft.probs,
                    config.rule,
                    config.temperature,
                    generator,
                    config.relaxable,
                )
            else:
                verdict = verify_greedy(logits, draft.tokens, config.rule, config.relaxable)

        accepted, relaxed_flags, margins, top1 = _read_step(verdict)
        tokens = [*accepted, verdict.next_token]
        relaxed_at = tuple(i for i, flag in enumerate(relaxed_flags) if flag)
        relaxed = [*relaxed_flags, False]
        finished = False
        judged = verdict.n_accepted  # accepted drafts the sequence goes on from
        for i, tok in enumerate(tokens):
            if tok in config.eos_token_ids:
                tokens, relaxed, finished = tokens[:i], relaxed[:i], True
                judged = min(judged, i + 1)  # drafts after an accepted EOS never count: the text ended
                break
        if config.adaptive_k and n_draft:
            all_accepted = verdict.n_accepted == n_draft
            draft_len = min(config.k, draft_len + 2) if all_accepted else max(1, draft_len - 1)
        keep = min(len(tokens), budget - produced)
        tokens, relaxed = tokens[:keep], relaxed[:keep]
        kept_relaxed = relaxed_at[: sum(relaxed)]  # relaxed flags cut with the tokens at EOS or limits
        replaced = tuple(top1[i] for i in kept_relaxed) if top1 else ()

        # Accepted chain drafts are in place already. What is new (the correction or bonus token, and a
        # sibling a tree's path ends in) is written from the host values the verdict brought: a scalar
        # fill each, not a copy of the step's tokens back to the device.
        placed = verdict.chain_prefix if isinstance(verdict, TreeVerification) else verdict.n_accepted
        for i in range(placed, len(tokens)):
            seq[length + i] = tokens[i]
        # Accepted drafts are cached already; the newest token stays pending.
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

        ended_in_draft = judged < verdict.n_accepted
        judged_relaxed = tuple(p for p in relaxed_at if p < judged)
        stats.record(
            StepRecord(
                drafted=n_draft,
                siblings=len(tree) - n_draft if tree is not None else 0,
                accepted_exact=judged - len(judged_relaxed),
                accepted_relaxed=len(judged_relaxed),
                rejected=verdict.n_accepted < n_draft and not ended_in_draft,
                emitted=len(tokens),
                margins=tuple(margins[:judged]) if ended_in_draft else tuple(margins),
                relaxed_at=judged_relaxed,
                unjudged=n_draft - judged if ended_in_draft else 0,
            )
        )
        stats.new_tokens = produced
        stats.target_forward_s = target.clock.seconds - target_s0
        if unread_prefill:
            # Read here, not right after the prefill: on an accelerator that read would wait for the
            # device. The target's forwards since are this step's verification, the clock's last.
            stats.prefill_s = stats.target_forward_s - target.clock.last
            unread_prefill = False
        if draft_lm is not None:
            stats.draft_forward_s = draft_lm.clock.seconds - draft_s0
            stats.draft_forwards = draft_lm.clock.calls - draft_calls0
        stats.stopped_at_eos = finished
        yield Step(
            tokens=tokens,
            relaxed=relaxed,
            finished=finished,
            relaxed_top1=replaced,
            relaxed_margins=tuple(margins[i] for i in kept_relaxed),
        )
        if finished:
            return


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


def _read_step(verdict: Verification) -> tuple[list[int], list[bool], list[float], list[int]]:
    """The step as Python values: accepted tokens, their relaxed flags, the rule's margins and the
    target's top-1 at the accepted positions (empty when the verification has none). Verification
    already read them back to the host in the step's one copy, so nothing here waits on a device."""
    n = verdict.n_accepted
    top1 = verdict.top1[:n].tolist() if verdict.top1 is not None else []
    return list(verdict.tokens), verdict.relaxed.tolist(), verdict.margins.tolist(), top1
