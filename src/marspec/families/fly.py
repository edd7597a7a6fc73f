"""``fly`` (FLy, Li et al. 2025, arXiv 2511.22972): a rival that does not judge a row alone.

A draft token the lossless test rejects is accepted (deferred) where the target is uncertain there (the
entropy of its three most likely tokens is at least ``theta``, in nats) and the next ``window`` draft
tokens, scored after it in the same forward, all pass the lossless test. ``theta`` above ln 3 (the
largest entropy of three probabilities) never relaxes. Its decision needs the block, so it is
:func:`fly_defers`, over ragged blocks passed flattened; it defers along one chain, so not in a tree.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, ClassVar

from marspec.errors import MarspecError
from marspec.families.base import NATS, Family, Scores, Setting, ThetaMeaning, ThetaTable

if TYPE_CHECKING:
    import torch

# FLy's entropy is over the target's three most likely tokens (the source's choice), so it is <= ln 3.
FLY_TOP = 3
FLY_MAX_ENTROPY = math.log(FLY_TOP)


class Fly(Family):
    names = ("fly",)
    margin_theta = False
    takes_window = True
    needs_rows = True
    guards = ("none", "class", "thinking")
    row_refusal = "FLy judges a draft block, not a row: use fly_defers (verify_greedy does)"
    tree_refusal = "FLy defers along a draft chain, not a token tree: drop the tree"

    thetas: ClassVar[ThetaTable] = {
        ("fly", None): ThetaMeaning(
            "the entropy of the target's top 3 >= theta, and the next window drafts pass the lossless test",
            NATS,
            0.0,
            math.inf,
            False,
            "theta > ln 3 = 1.0986",
            "use an entropy threshold >= 0 in nats (defer a mismatch where the target's top-3 entropy "
            "is at least theta; above ln 3 = 1.0986 never relaxes)",
        )
    }

    def relaxes(self, rule: Setting) -> bool:
        return rule.theta is not None and rule.theta <= FLY_MAX_ENTROPY  # the top-3 entropy is <= ln 3

    def check(self, rule: Setting) -> None:
        window = rule.window
        if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
            problem = (
                "rule 'fly' needs a window"
                if window is None
                else f"window={window!r} is invalid for rule 'fly'"
            )
            raise MarspecError(
                f"{problem}: use an integer >= 1 (the draft tokens after a mismatch that must all pass the "
                "lossless test for it to be deferred)",
                field="window",
            )

    def relaxed(self, scores: Scores, rule: Setting) -> torch.Tensor:
        assert scores.native is not None  # the verifiers pass where the lossless test passes
        return fly_defers(scores.rows, scores.draft, scores.native, rule, scores.temperature, scores.lengths)


FLY = Fly()


def fly_defers(
    rows: torch.Tensor,
    draft_tokens: torch.Tensor,
    native: torch.Tensor,
    rule: Setting,
    temperature: float = 1.0,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[N]``: where FLy accepts a draft token the lossless test rejected (a deferred mismatch).

    ``rows``: ``[N, V]``, the target's logits at the ``N`` draft positions, each scored after the draft
    tokens before it (one verification forward); ``native``: bool ``[N]``, where the lossless test
    passes (greedy: the draft is the target's top-1; sampling: the random test). The positions are
    blocks of consecutive drafts, ``lengths`` (``long[B]``, summing to ``N``) of them, or one block when
    None, so a ragged batch can be passed flattened. A position ``i`` is deferred when it fails the
    lossless test, the target gives the draft token a probability above 0, the entropy of the target's
    three most likely tokens there (at ``temperature``) is at least ``rule.theta``, and the next
    ``rule.window`` draft tokens of its block exist and all pass the lossless test. No host sync.
    """
    import torch

    n = draft_tokens.shape[0]
    device = rows.device
    if not rule.relaxes or n == 0:
        return torch.zeros(n, dtype=torch.bool, device=device)
    assert rule.window is not None  # Rule sets FLy's window
    window = rule.window
    draft = draft_tokens.to(device=device, dtype=torch.long)
    logp = torch.log_softmax(rows.float() / temperature, dim=-1)  # [N, V]
    top = logp.topk(min(FLY_TOP, logp.shape[-1]), dim=-1).values  # [N, 3]
    # A zero probability adds nothing to the entropy (and 0 * -inf would be nan).
    entropy = -torch.where(top > float("-inf"), top.exp() * top, torch.zeros_like(top)).sum(-1)  # [N]
    possible = logp.gather(1, draft[:, None])[:, 0] > float("-inf")  # [N]
    index = torch.arange(n, device=device)
    if lengths is None:
        remaining = n - 1 - index  # [N]: draft tokens after each position in its block
    else:
        lengths = lengths.to(device=device, dtype=torch.long)
        ends = torch.cumsum(lengths, 0)  # [B]: one past each block's last position
        block = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths, output_size=n)
        remaining = ends[block] - 1 - index
    # Native passes in (i, i + window], by differences of a running count; only read where the whole
    # window lies in the block, so it never counts across a block's end.
    count = torch.cat([native.new_zeros(1, dtype=torch.long), native.long().cumsum(0)])  # [N+1]
    ahead = count[(index + window + 1).clamp(max=n)] - count[index + 1]  # [N]
    window_passes = (remaining >= window) & (ahead == window)
    return ~native & possible & (entropy >= rule.theta) & window_passes
