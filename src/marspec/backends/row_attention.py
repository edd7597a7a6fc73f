"""Attention computed one query row at a time, so that a token's result does not depend on its forward.

Plain decoding scores each token in a one-token forward; verification scores the same token as one row
of a many-token forward. In fp32 the two differ only by rounding (~1e-6), and a near-tie almost never
flips. An int8 target re-quantises every linear layer's input, which turns a 1e-6 difference at a
rounding boundary into a whole quantisation step, so those near-ties flip often enough to break strict
== plain within 64 tokens. Its linear layers are exact per row (:class:`RowwiseInt8Linear`); the one other
place where rows meet is attention, where a many-query kernel sums in another order than a one-query
call. Here every row is attended by the same one-query call plain decoding makes: query row ``i`` of a
chain forward over ``q`` new tokens sees the first ``kv - q + i + 1`` cached positions, the prefix plain
decoding's forward at that position sees. That costs ~5-10% of a 13-token verification and ~10% of a
prefill on this CPU (measured with the int8 target, one thread).

A token-tree forward passes its own mask (a node sees its ancestors, not the whole prefix); its rows are
attended one at a time under that mask, which is exact per row but not the prefix call plain decoding
makes, so trees keep fp32's rounding-level guarantee only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from marspec.errors import MarspecError

ROW_ATTENTION = "marspec_row_by_row"


def row_by_row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, D]
    key: torch.Tensor,  # [B, H_kv, kv, D]: the cache including this forward's q tokens
    value: torch.Tensor,  # [B, H_kv, kv, D]
    attention_mask: torch.Tensor | None,  # None for a chain forward, [B, 1, q, kv] for a tree
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [B, q, H, D] and no weights."""
    if kwargs.get("softcap") is not None:
        raise MarspecError("row-by-row attention does not implement logit soft-capping")
    q_len, kv_len = query.shape[2], key.shape[2]
    rows = []
    for i in range(q_len):
        # A contiguous copy: the one-query call then sees the same layout whichever forward it is in.
        row = query[:, :, i : i + 1].contiguous()  # [B, H, 1, D]
        if attention_mask is None:
            end = kv_len - q_len + i + 1
            keys, values, mask = key[:, :, :end], value[:, :, :end], None
        else:
            keys, values, mask = key, value, attention_mask[:, :, i : i + 1]
        rows.append(
            F.scaled_dot_product_attention(row, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
        )
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ROW_ATTENTION, row_by_row_attention)


def use_row_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to :func:`row_by_row_attention`; only causal models whose every layer attends to
    the whole prefix qualify (a sliding window sees another range than the prefix rule assumes)."""
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise MarspecError(
            f"{type(model).__name__} has sliding-window or other non-causal attention layers "
            f"({', '.join(sorted(layer_types))}), which an int8 target does not support here: use "
            "target_quant='none'"
        )
    model.set_attn_implementation(ROW_ATTENTION)
