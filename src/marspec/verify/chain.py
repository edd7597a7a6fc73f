"""What every chain verifier shares: its outcome, its checks, its one read-back and its token draw.

:func:`~marspec.verify.greedy.verify_greedy`, :func:`~marspec.verify.sampling.verify_sampling` and
:func:`~marspec.verify.block.verify_block` each judge a chain of ``K`` draft tokens against the target's
``[K+1, V]`` logits and return a :class:`Verification`; the tree verifier returns a subclass of it. They
check their arguments the same way, count the leading accepts the same way, read the result back in the
same single device-to-host copy (:func:`to_host`), and the two sampled ones draw their token by the same
inverted CDF (as the drafters do, through :func:`sample_token`), so these live here once rather than in
whichever family used them first.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from marspec.errors import MarspecError, ModelOutputError


@dataclass(frozen=True)
class Verification:
    """The outcome of verifying one block of ``K`` draft tokens, on the host.

    The verify functions read everything back in one device-to-host copy, so a decode step that reads
    these fields pays no further synchronisation; the tensors here are CPU tensors.
    """

    n_accepted: int  # draft tokens accepted, 0..K
    next_token: int  # correction token (n_accepted < K) or bonus token (n_accepted == K)
    relaxed: torch.Tensor  # bool[n_accepted]: True where that accepted draft token was a relaxed accept
    # float32[K]: the rule's margin measure at each draft position, for statistics (logit_ratio is
    # inf/nan where z1 == 0; the rule itself never relaxes there)
    margins: torch.Tensor
    # long[K]: the target's top-1 at each draft position (what strict would take): where a token was
    # relaxed, the one it replaced. Read only at relaxed positions, for audits.
    top1: torch.Tensor | None = None
    tokens: tuple[int, ...] = ()  # the accepted draft tokens (n_accepted of them)

    @property
    def n_relaxed(self) -> int:
        """How many of the accepted draft tokens were relaxed accepts."""
        return int(self.relaxed.sum())

    def emitted(self) -> list[int]:
        """The tokens this step commits: the accepted draft tokens followed by ``next_token``."""
        return [*self.tokens, self.next_token]


def _check_sampling(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: float,
) -> int:
    """Check a sampling verification's temperature and shapes, and return ``K``."""
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature > 0):
        raise MarspecError(
            f"temperature={temperature!r} is invalid for sampling: use a finite number > 0 "
            f"(or verify_greedy for temperature 0)"
        )
    k = _check_block(target_logits, draft_tokens)
    vocab = target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must be [K, V] = [{k}, {vocab}], got {list(draft_probs.shape)}")
    return k


def sample_token(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token (long[1]) drawn from unnormalised ``weights`` [V] with randomness from ``generator``."""
    return _sample(weights, torch.rand((), generator=generator, device=weights.device))


def _sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token drawn from unnormalised ``weights`` [V] by inverting the CDF at the uniform ``u`` (0-dim).

    Used instead of ``torch.multinomial``, which costs ~20 ms per draw on CPU at a 150k vocabulary.
    """
    cdf = weights.cumsum(0)  # [V]
    total = cdf[-1]
    # Keep x strictly below the total so the search lands on a token whose weight is positive.
    x = torch.minimum(u * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, x.view(1), right=True)  # long[1]


def _check_block(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> int:
    """Check the ``[K+1, V]`` / ``[K]`` shapes and return ``K``."""
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
        shape = list(draft_tokens.shape)
        raise ValueError(f"draft_tokens must be an integer tensor [K], got {draft_tokens.dtype} {shape}")
    k = draft_tokens.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must be [K+1, V] = [{k + 1}, V], got {list(target_logits.shape)}")
    return k


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in a 1-D bool tensor, as a 0-dim long tensor (no host sync)."""
    return mask.long().cumprod(0).sum()


def to_host(*parts: torch.Tensor) -> list[torch.Tensor]:
    """``parts`` on the host in one device-to-host copy (the step's one synchronisation), each flattened
    and as float64, which holds token ids (< 2^53), flags and float32 margins exactly."""
    host = torch.cat([p.reshape(-1).to(torch.float64) for p in parts]).cpu()
    return list(host.split([p.numel() for p in parts]))


def finite_flag(probs: torch.Tensor) -> torch.Tensor:
    """True (0-dim) when every value of ``probs`` (probabilities, so none is negative) is finite: then and
    only then is their sum (one pass; ``isfinite(probs).all()`` took ~50x as long on a CPU). Read back
    with the verdict (no extra synchronisation) so that :func:`_read_back` refuses a draw from NaN or
    infinite probabilities."""
    return torch.isfinite(probs.sum())


def _read_back(
    n: torch.Tensor,
    token: torch.Tensor,
    draft: torch.Tensor,
    relaxed: torch.Tensor,
    margins: torch.Tensor,
    top1: torch.Tensor,
    finite: torch.Tensor | None = None,
) -> Verification:
    """A chain verification on the host, in one device-to-host copy: the accepted count ``n`` and the
    next token (0-dim each), and the ``[K]`` draft tokens, relaxed flags, margins and target top-1.
    ``finite``: a sampling step's :func:`finite_flag`; when it is 0 the step's token was drawn from NaN or
    infinite probabilities (a token id that may not exist) and a :class:`ModelOutputError` is raised
    instead of returning it."""
    flag = [] if finite is None else [finite]
    n_h, token_h, draft_h, relaxed_h, margins_h, top1_h, *finite_h = to_host(
        n, token, draft, relaxed, margins, top1, *flag
    )
    if finite_h and not finite_h[0][0]:
        raise ModelOutputError(
            "the target's probabilities at this step hold NaN or infinite values (its logits overflowed "
            "or are not numbers), so no token can be sampled from them: check the model's weights and "
            "dtype (fp32 avoids fp16's overflow), or decode greedily (temperature=0)"
        )
    n_accepted = int(n_h[0])
    return Verification(
        n_accepted=n_accepted,
        next_token=int(token_h[0]),
        relaxed=relaxed_h[:n_accepted].bool(),
        margins=margins_h.float(),
        top1=top1_h.long(),
        tokens=tuple(int(t) for t in draft_h[:n_accepted].tolist()),
    )
