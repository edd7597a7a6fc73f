"""marspec's accept rule on vLLM's flattened, ragged batches, and the counters it keeps.

vLLM verifies a whole batch at once: the target's processed logits of every request are flattened into
one ``[N, V]`` tensor (temperature-divided for sampled requests, raw for greedy ones) beside the draft
token each row verifies. Rather than re-implementing vLLM's kernels, the plugin forces the rows where
the rule accepts on a close call so that vLLM's own strict verification must accept them (the row
becomes one-hot at the draft token: argmax for greedy requests, ``p(d) = 1`` for sampled ones), and
puts those rows back once vLLM has verified. Every other row is never touched, so the correction token
after the first rejection, the bonus token, seeding, top-k/top-p and logprobs all stay vLLM's. The
decision itself is :func:`marspec.verify.relax.rule_relaxes`, the same code the marspec decoder uses.
MARS and the rivals ``typical``, ``pthresh`` and ``topk`` fit this forcing scheme, since each decides a
row from that row's logits and draft token alone (on a sampled row the logits are already
temperature-divided, so a rival tests the tempered distribution, as it does in marspec's own sampling
loop). FLy (``fly``) decides a row from its request's following rows too: whether the next ``window``
drafts are the target's top-1, which the same ``[N, V]`` logits tell for greedy requests, so greedy FLy
fits as well (:func:`marspec.verify.relax.fly_defers` on the flattened batch, one block per request). Sampled
requests do not: FLy defers a draft only where the following drafts pass vLLM's random test, whose
uniforms vLLM draws inside its verifier after the plugin has decided. Under ``fly`` the plugin
therefore verifies sampled requests strictly (lossless), and says so in the log when it activates.

Cost per verification step (see docs/vllm.md for the measured figure): one ``torch.topk(k=2)`` pass
over the ``[N, V]`` logits, and a save, fill and restore of the relaxed rows only (no full copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from marspec.rules import Rule
from marspec.verify.relax import rule_relaxes

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for the output slots after a rejection (and for unusable drafts)


@dataclass(frozen=True)
class Decisions:
    """The rule's verdict on each row of a flattened batch."""

    relaxed: torch.Tensor  # bool[N]: close-call accepts (draft is the target's top-1 or top-2): forced rows
    exact: torch.Tensor  # bool[N]: draft token is the target's top-1


def decide(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    rule: Rule,
    rows: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> Decisions:
    """``rule``'s verdict on ``logits`` (``[N, V]``) against ``draft_tokens`` (``[N]``, >= 0).

    ``rows`` (bool ``[N]``) marks the rows that verify a real draft token; the others (vLLM's bonus
    rows, placeholder drafts) are neither exact nor relaxed. Top-2 comes from ``torch.topk``: one pass
    over the logits and no copy of them. On an exact tie of logits ``torch.topk`` may rank the tied
    tokens in another order than ``argmax``; for MARS a tie of the top two is a close call that accepts
    either, so only the exact/relaxed split of the counters could differ there.

    FLy alone reads the two last arguments: ``lengths`` (long ``[B]``, summing to ``N``) splits the rows
    into the requests' consecutive blocks (None: one block), since a deferral looks at the following
    rows of its own request only; ``greedy`` (bool ``[N]``, None: every row) marks the rows of greedy
    requests, the only ones FLy relaxes (sampled rows are verified strictly: see the module doc).
    """
    values, tokens = torch.topk(logits, 2, dim=-1)  # [N, 2], [N, 2]
    draft = draft_tokens.to(device=tokens.device, dtype=tokens.dtype)  # [N]
    exact = draft == tokens[:, 0]  # [N]
    if rows is not None:
        exact = exact & rows
    # A row that verifies nothing is not "accepted by the lossless test", so no FLy window spans it.
    relaxed = rule_relaxes(logits, values, tokens, draft, exact, rule, lengths=lengths)  # [N]
    if rule.family.row_refusal and greedy is not None:  # a block decision: greedy rows only
        relaxed = relaxed & greedy
    if rows is not None:
        relaxed = relaxed & rows
    return Decisions(relaxed, exact)


@dataclass(frozen=True)
class RuleTable:
    """The rules of one batch: ``rules[0]`` is the deployment's, the others those requests asked for.

    ``of_request`` (long ``[B]``, on the batch's device) indexes ``rules`` per request, None when every
    request has the deployment's rule (then nothing per request is computed)."""

    rules: tuple[Rule, ...]
    of_request: torch.Tensor | None = None

    @classmethod
    def build(cls, default: Rule, requested: Sequence[Rule | None], device: torch.device) -> RuleTable:
        """The table for requests asking for ``requested`` (None: the deployment's ``default``)."""
        if all(rule is None for rule in requested):
            return cls((default,))
        rules = [default]
        index = []
        for rule in requested:
            chosen = default if rule is None else rule
            if chosen not in rules:
                rules.append(chosen)
            index.append(rules.index(chosen))
        return cls(tuple(rules), torch.tensor(index, dtype=torch.long, device=device))

    @property
    def names(self) -> tuple[str, ...]:
        """The distinct rule names, in first-seen order (what the counters are labelled by)."""
        return tuple(dict.fromkeys(str(rule.name) for rule in self.rules))

    def name_of_request(self) -> torch.Tensor | None:
        """Long ``[B]``: each request's index into :attr:`names` (None: every request has ``names[0]``)."""
        if self.of_request is None:
            return None
        names = self.names
        lookup = [names.index(str(rule.name)) for rule in self.rules]
        return torch.tensor(lookup, dtype=torch.long, device=self.of_request.device)[self.of_request]


def decide_each(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    table: RuleTable,
    row_rule: torch.Tensor | None,
    rows: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> Decisions:
    """:func:`decide` with each row's own rule: ``row_rule`` (long ``[N]``) indexes ``table.rules`` per
    row (None: ``table.rules[0]`` for every row). One pass per distinct rule of the batch."""
    first = decide(logits, draft_tokens, table.rules[0], rows, lengths, greedy)
    if row_rule is None or len(table.rules) == 1:
        return first
    relaxed = first.relaxed & (row_rule == 0)
    for index, rule in enumerate(table.rules[1:], start=1):
        relaxed |= decide(logits, draft_tokens, rule, rows, lengths, greedy).relaxed & (row_rule == index)
    return Decisions(relaxed, first.exact)


@contextmanager
def forced(logits: torch.Tensor, relaxed: torch.Tensor, draft_tokens: torch.Tensor) -> Iterator[None]:
    """Inside the block, each ``relaxed`` row of ``logits`` is one-hot at its draft token (``-inf``
    elsewhere, ``0`` there); on leaving, those rows hold their own values again.

    In place, so vLLM's verifier sees the forced rows in the tensor it was handed, and whatever vLLM
    reads from that tensor afterwards (logprobs) is as it would be without the plugin. Only the relaxed
    rows are saved and written. Finding them reads one small index tensor back from the device.
    """
    rows = relaxed.nonzero().squeeze(1)  # long[R]
    if rows.numel() == 0:
        yield
        return
    saved = logits[rows]  # [R, V]: a copy (advanced indexing; cheaper than index_select on CPU here)
    logits.index_fill_(0, rows, float("-inf"))
    logits[rows, draft_tokens[rows].long()] = 0.0
    try:
        yield
    finally:
        logits.index_copy_(0, rows, saved)


@dataclass(frozen=True)
class V2Layout:
    """Which rows of vLLM's V2 verification batch verify a draft token, and which token.

    V2 hands its verifier ``[L, V]`` logits holding, per request, one row per draft position and then
    its bonus row (``cu_num_logits`` delimits requests); row ``r`` verifies the input token of row
    ``r + 1`` (``draft_sampled[r + 1]``), and ``-1`` marks a draft vLLM will not accept (a placeholder):
    its kernel stops at the first one, so the rows after it in that request verify nothing either.
    """

    draft_tokens: torch.Tensor  # long[L]: the token each row verifies (0 where it verifies none)
    rows: torch.Tensor  # bool[L]: rows that verify a real draft token
    num_draft_tokens: torch.Tensor  # long[R]: such rows per request (they lead its block)
    greedy: torch.Tensor  # bool[L]: the row's request is greedy
    num_logits: torch.Tensor  # long[R]: rows per request (its drafts, placeholders and bonus row)


def v2_layout(
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    greedy_temperature: float,
) -> V2Layout:
    """Read V2's batch layout from its verifier's arguments (see :class:`V2Layout`).

    ``temperature`` is indexed by request-state slot (``expanded_idx_mapping[r]`` for row ``r``), as
    V2's kernels read it; ``greedy_temperature`` is the value that means greedy.
    """
    cu = cu_num_logits.long()  # [R + 1]
    logits_per_request = torch.diff(cu)  # [R]
    n_rows = draft_sampled.shape[0]
    request = torch.repeat_interleave(
        torch.arange(logits_per_request.shape[0], device=cu.device), logits_per_request, output_size=n_rows
    )  # [L]
    start = cu[:-1][request]  # [L]
    local = torch.arange(n_rows, device=cu.device) - start  # [L]
    verified = torch.cat(
        [draft_sampled[1:].long(), draft_sampled.new_full((1,), PLACEHOLDER_TOKEN_ID).long()]
    )
    draft_row = local < logits_per_request[request] - 1  # [L]: not the bonus row
    unusable = (draft_row & (verified < 0)).long()  # [L]
    before = torch.cumsum(unusable, 0) - unusable  # [L]: unusable rows before r, batch-wide
    rows = draft_row & (unusable == 0) & (before == before[start])  # none before r in its own request
    num_draft_tokens = torch.zeros_like(logits_per_request).index_add_(0, request, rows.long())  # [R]
    greedy = temperature[expanded_idx_mapping.long()] == greedy_temperature  # [L]
    return V2Layout(verified.clamp(min=0), rows, num_draft_tokens, greedy, logits_per_request)


def accepted_lengths(output_token_ids: torch.Tensor) -> torch.Tensor:
    """Long ``[B]``: draft tokens accepted per request, from vLLM's ``[B, S+1]`` output (accepted drafts,
    then the correction or bonus token, then ``-1``)."""
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(1) - 1


def counts_from_cumulative(cu_num_tokens: torch.Tensor) -> torch.Tensor:
    """Long ``[B]`` per-request counts from vLLM's cumulative ``[B]`` (e.g. ``cu_num_draft_tokens``)."""
    cu = cu_num_tokens.long()
    return torch.diff(cu, prepend=cu.new_zeros(1))


def accepted_drafts(output_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Bool ``[T]``: which flattened draft tokens vLLM accepted.

    ``output_token_ids``: ``[B, S+1]`` as vLLM's rejection sampler returns it; ``num_draft_tokens``:
    ``long[B]`` on the same device.
    """
    total = int(num_draft_tokens.sum())
    return _accepted_mask(accepted_lengths(output_token_ids), num_draft_tokens, total)


def _accepted_mask(n_accepted: torch.Tensor, num_draft_tokens: torch.Tensor, total: int) -> torch.Tensor:
    # n_accepted, num_draft_tokens: long[B] -> bool[T]; ``total`` = T, known to the caller, so that
    # repeat_interleave need not read the counts back from the device.
    batch = num_draft_tokens.shape[0]
    request = torch.repeat_interleave(
        torch.arange(batch, device=num_draft_tokens.device), num_draft_tokens, output_size=total
    )
    starts = torch.cumsum(num_draft_tokens, 0) - num_draft_tokens  # [B]
    position = torch.arange(request.shape[0], device=request.device) - starts[request]  # [T]
    return position < n_accepted[request]


# The order of the counters in AcceptCounters.totals.
COUNTER_NAMES = ("steps", "drafted", "accepted_exact", "accepted_relaxed", "rejected")


class AcceptCounters:
    """Running totals over every verification the plugin has seen in this process, per rule name.

    Kept as device tensors updated in place, so counting adds no host sync to vLLM's step; a read
    (:meth:`snapshot`, :meth:`by_rule`) pays the copy. ``rejected`` counts verification blocks that
    ended in a rejection (as marspec's own DecodeStats does); ``steps`` counts verification blocks of
    requests that had draft tokens (a request with none is not a verification).
    Relaxed accepts are counted as marspec counts them: for greedy requests a close-call accept of the
    target's runner-up; for sampled requests any close-call accept (it skipped the random test).
    """

    def __init__(self) -> None:
        self.totals: dict[str, torch.Tensor] = {}  # rule name -> long [len(COUNTER_NAMES)]

    def record(
        self,
        decisions: Decisions,
        n_accepted: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        greedy_rows: torch.Tensor | None,
        names: Sequence[str],
        name_of_request: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of ``B`` requests and ``T`` draft rows (request ``i`` owning
        ``num_draft_tokens[i]`` consecutive rows of ``decisions``).

        ``n_accepted``: long ``[B]``, drafts vLLM accepted per request; ``greedy_rows``: bool ``[T]``,
        or None when every request is greedy; ``name_of_request``: long ``[B]`` indexing ``names`` (the
        rule each request was verified with), None when all were verified with ``names[0]``.
        """
        total = decisions.relaxed.shape[0]
        accepted = _accepted_mask(n_accepted, num_draft_tokens, total)  # [T]
        counted_relaxed = decisions.relaxed & ~decisions.exact
        if greedy_rows is not None:
            counted_relaxed = torch.where(greedy_rows, counted_relaxed, decisions.relaxed)
        relaxed_rows = accepted & counted_relaxed  # [T]
        per_request = torch.stack(  # [5, B]
            [
                (num_draft_tokens > 0).long(),
                num_draft_tokens.long(),
                n_accepted.long() - _per_request(relaxed_rows, num_draft_tokens),
                _per_request(relaxed_rows, num_draft_tokens),
                (n_accepted < num_draft_tokens).long(),
            ]
        )
        if name_of_request is None:
            self._add(names[0], per_request.sum(1))
            return
        for index, name in enumerate(names):
            self._add(name, (per_request * (name_of_request == index)).sum(1))

    def _add(self, name: str, step: torch.Tensor) -> None:
        if name not in self.totals:
            self.totals[name] = torch.zeros(len(COUNTER_NAMES), dtype=torch.long, device=step.device)
        self.totals[name] += step.to(self.totals[name].device)

    def by_rule(self) -> dict[str, dict[str, int]]:
        """The totals per rule name (the rules that verified at least one batch)."""
        return {
            name: dict(zip(COUNTER_NAMES, totals.tolist(), strict=True))
            for name, totals in self.totals.items()
        }

    def snapshot(self) -> dict[str, float]:
        """The totals over every rule, plus ``mean_accepted`` (accepted drafts per block) and
        ``relaxed_share``."""
        counts: dict[str, float] = dict.fromkeys(COUNTER_NAMES, 0)
        for totals in self.by_rule().values():
            for name, value in totals.items():
                counts[name] += value
        accepted = counts["accepted_exact"] + counts["accepted_relaxed"]
        counts["mean_accepted"] = accepted / counts["steps"] if counts["steps"] else 0.0
        counts["relaxed_share"] = counts["accepted_relaxed"] / accepted if accepted else 0.0
        return counts

    def reset(self) -> None:
        """Start counting from zero (e.g. between two measured runs in one process)."""
        self.totals.clear()


def _per_request(row_values: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Long ``[B]``: the sum of ``row_values`` (``[T]``) over each request's consecutive rows."""
    request = torch.repeat_interleave(
        torch.arange(num_draft_tokens.shape[0], device=num_draft_tokens.device),
        num_draft_tokens,
        output_size=row_values.shape[0],
    )
    return torch.zeros_like(num_draft_tokens, dtype=torch.long).index_add_(0, request, row_values.long())
