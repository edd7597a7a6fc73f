"""marspec's accept rule on vLLM's flattened, ragged batches, and the counters it keeps.

vLLM verifies a whole batch at once: the draft tokens of every request are flattened into one ``[T]``
tensor (``T`` = total draft tokens, request ``i`` owning ``num_draft_tokens[i]`` consecutive rows) and
the target's processed logits into ``[T, V]`` (temperature-divided for sampled requests, raw for greedy
ones). Rather than re-implementing vLLM's kernels, the plugin rewrites the rows where MARS accepts on a
close call so that vLLM's own strict verification must accept them (the row becomes one-hot at the
draft token: argmax for greedy requests, ``p(d) = 1`` for sampled ones). Every other row is untouched,
so the correction token after the first rejection, the bonus token, seeding and top-k/top-p all stay
vLLM's. The decision itself is :func:`marspec.verify.relaxed_accepts`, the same code the marspec
decoder uses. Every rule fits this forcing scheme, since each decides a row from that row's logits and
draft token alone: MARS, and the rivals ``typical``, ``pthresh`` and ``topk`` (on a sampled row the
logits are already temperature-divided, so a rival tests the tempered distribution, as it does in
marspec's own sampling loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marspec.verify import Rule, relaxed_accepts, top2

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for the output slots after a rejection


@dataclass(frozen=True)
class RelaxedBatch:
    """Target logits with MARS's close-call accepts forced, and what was forced where."""

    logits: torch.Tensor  # [T, V]: the input itself when nothing can relax, else a rewritten copy
    relaxed: torch.Tensor  # bool[T]: close-call accepts (draft is the target's top-1 or top-2)
    exact: torch.Tensor  # bool[T]: draft token is the target's top-1


def relax_close_calls(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, rule: Rule) -> RelaxedBatch:
    """Apply ``rule``'s close-call accepts to a flattened batch ``[T, V]`` / ``[T]`` (see the module doc).

    No host sync: the rewrite is a masked fill and a scatter whatever the number of close calls.
    """
    values, tokens = top2(target_logits)  # [T, 2], [T, 2]
    draft = draft_token_ids.long()  # [T]
    exact = draft == tokens[:, 0]  # [T]
    if not rule.relaxes:
        return RelaxedBatch(target_logits, torch.zeros_like(exact), exact)
    relaxed = relaxed_accepts(target_logits, values, tokens, draft, rule)  # [T]
    forced = target_logits.masked_fill(relaxed[:, None], float("-inf"))  # [T, V]
    kept = target_logits.gather(1, draft[:, None])  # [T, 1]: the draft's own logit where not relaxed
    forced.scatter_(1, draft[:, None], torch.where(relaxed[:, None], torch.zeros_like(kept), kept))
    return RelaxedBatch(forced, relaxed, exact)


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
    """Running totals over every verification the plugin has seen in this process.

    Kept as one device tensor updated in place, so counting adds no host sync to vLLM's step; a read
    (:meth:`snapshot`) pays the one copy. ``rejected`` counts verification blocks that ended in a
    rejection (as marspec's own DecodeStats does); ``steps`` counts verification blocks of requests
    that had draft tokens (a request with none is not a verification).
    Relaxed accepts are counted as marspec counts them: for greedy requests a close-call accept of the
    target's runner-up; for sampled requests any close-call accept (it skipped the random test).
    """

    def __init__(self) -> None:
        self.totals = torch.zeros(len(COUNTER_NAMES), dtype=torch.long)

    def record(
        self,
        batch: RelaxedBatch,
        output_token_ids: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        greedy_rows: torch.Tensor | None,
    ) -> None:
        """Add one batch. ``greedy_rows``: bool ``[T]``, or None when every request is greedy."""
        n_accepted = accepted_lengths(output_token_ids)  # [B]
        accepted = _accepted_mask(n_accepted, num_draft_tokens, batch.relaxed.shape[0])  # [T]
        counted_relaxed = batch.relaxed & ~batch.exact
        if greedy_rows is not None:
            counted_relaxed = torch.where(greedy_rows, counted_relaxed, batch.relaxed)
        relaxed = (accepted & counted_relaxed).sum()
        step = torch.stack(
            [
                (num_draft_tokens > 0).sum(),
                num_draft_tokens.sum(),  # on the device already: no per-step copy of T from the host
                accepted.sum() - relaxed,
                relaxed,
                (n_accepted < num_draft_tokens).sum(),
            ]
        )
        if self.totals.device != step.device:
            self.totals = self.totals.to(step.device)
        self.totals += step

    def snapshot(self) -> dict[str, float]:
        """The totals, plus ``mean_accepted`` (accepted drafts per block) and ``relaxed_share``."""
        counts = dict(zip(COUNTER_NAMES, self.totals.tolist(), strict=True))
        accepted = counts["accepted_exact"] + counts["accepted_relaxed"]
        counts["mean_accepted"] = accepted / counts["steps"] if counts["steps"] else 0.0
        counts["relaxed_share"] = counts["accepted_relaxed"] / accepted if accepted else 0.0
        return counts

    def reset(self) -> None:
        """Start counting from zero (e.g. between two measured runs in one process)."""
        self.totals.zero_()
