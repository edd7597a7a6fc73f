"""A row of logits' best token, or best two, in one pass on the CPU: the same answers as torch's operators.

A decode step reads its vocabulary-wide rows a few times: the verification takes the top two of every scored
row (:func:`marspec.verify.margins.top2`), a draft model's step the argmax of its row. torch's CPU argmax
reads a 150k-token row at ~2 G values a second, so on 2 cores these cost about 1 ms of a ~100 ms step alone
and more in a batch, where each sequence's rows are read one sequence after another between forwards. The
kernels' ``vocab_argmax`` and ``vocab_top2`` (kernels/vocab.cpp) read a row once at the speed of memory and
answer exactly as torch does, ties, -inf and NaN included (tests/test_top_tokens.py), so which one runs never
changes a token. It is taken for float32 rows on the CPU once the kernels' library is loaded (the CPU engines
load it); anything else runs torch's operators.
"""

from __future__ import annotations

from typing import Any

import torch


def kernel_takes(logits: torch.Tensor) -> bool:
    """Whether the kernels' vocabulary operators answer for ``logits`` ``[..., V]``: float32 on the CPU,
    not empty, and the kernels' library loaded in this process (never built for this alone)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() >= 1
        and logits.numel() > 0
        and _library_loaded()
    )


def _library_loaded() -> bool:
    # Imported here: the backends import transformers, which deciding a rule or a margin never needs.
    from marspec.backends.kernels import library_loaded

    return library_loaded()


def _ops() -> Any:
    from marspec.backends.kernels import ops

    return ops()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``: each row's largest logit's token (the first of equal ones),
    long, the rows' shape."""
    if kernel_takes(logits):
        return _ops().vocab_argmax(logits)
    return torch.argmax(logits, dim=-1)


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values[..., 2], tokens[..., 2])``: each row's argmax and the argmax of the row with it masked
    to -inf (on an exact tie the other tied token), with their logits."""
    if kernel_takes(logits):
        return _ops().vocab_top2(logits)
    return torch_top2(logits)


def torch_top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top2` by torch's operators, on any device and dtype: the argmax, a copy with it masked, the
    argmax of the copy."""
    first = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    second = logits.scatter(-1, first, float("-inf")).argmax(dim=-1, keepdim=True)  # [..., 1]
    tokens = torch.cat([first, second], dim=-1)  # [..., 2]
    return logits.gather(-1, tokens), tokens
