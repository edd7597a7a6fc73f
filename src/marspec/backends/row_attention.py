"""Attention computed one query row at a time, so that a token's result does not depend on its forward.

Plain decoding scores each token in a one-token forward; verification scores the same token as one row
of a many-token forward. In fp32 the two differ only by rounding (~1e-6), and a near-tie almost never
flips. An int8 target re-quantises every linear layer's input (an int4 one rounds it to bf16), which
turns a 1e-6 difference at a rounding boundary into a whole quantisation step, so those near-ties flip
often enough to break strict == plain within 64 tokens. Its linear layers are exact per row
(:class:`RowwiseInt8Linear`, :class:`~marspec.backends.int4.Int4Linear`); the one other
place where rows meet is attention, where a many-query kernel sums in another order than a one-query
call. Here every row is attended by the same one-query call plain decoding makes: query row ``i`` of a
chain forward over ``q`` new tokens sees the first ``kv - q + i + 1`` cached positions, the prefix plain
decoding's forward at that position sees. That costs ~5-10% of a 13-token verification and ~10% of a
prefill on this CPU (measured with the int8 target, one thread).

A token-tree forward passes its own mask (a node sees the cache and its own ancestors). A row whose
visible positions are a prefix (the chain's nodes) is attended over that prefix as above; another node's
visible keys and values are gathered into a sequence of their own, the sequence plain decoding would
have cached had it taken that node's path, and attended the same way.

Where marspec's kernels run (:func:`marspec.backends.kernels.kernels_available`), every row of a layer is
attended in one call of their ``attention_rows`` (``kernels/attention.cpp``), which computes each
(row, head) alone in an order set by its own prefix: the same bits as that row attended alone. On the
default target's layers (12 heads of 128, 200 cached positions) a 13-row verification's attention took
114 us against 402 us for 13 SDPA calls, a one-token step's 18 us against 32 us
(``benchmarks/row_attention.py``). Elsewhere each row is one SDPA call as above.

The kernel also reads an fp16 cache (``HFCausalLM(kv_dtype=torch.float16)``: half the memory): each key
and value is rounded once, when written (the same rounding whichever forward writes it), and read widened
exactly, so a row's bits still do not depend on its forward. Caches stay in the model's dtype by default:
on a Zen 4 the kernel over fp16 ran no faster than over float32 at 256-32,768 positions, its work bound by
arithmetic rather than by the bytes read (``benchmarks/row_attention.py --fp16``).

Only what marspec's models pass is supported: one sequence (batch 1 whenever there is a mask), causal
attention over the whole prefix or a sliding window of it (each row its own last ``sliding_window``
positions: Gemma 3's local layers, a Mistral or Phi-3 configuration's window); a 2D padding mask
never reaches this function (transformers drops it for an attention without a mask builder), so batches
with padding are not handled.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from marspec.errors import MarspecError

ROW_ATTENTION = "marspec_row_by_row"
# The keyword a packed forward of several sequences (:mod:`marspec.backends.packed`) passes its row
# layout by: transformers hands a model forward's extra keyword arguments down to the attention function.
PACKING_KEYWORD = "marspec_packing"


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
    """transformers' attention-function signature; returns [B, q, H, D] and no weights. A packed forward
    of several sequences (``kwargs[PACKING_KEYWORD]``) attends each sequence's rows against its own cache,
    each row as here."""
    window = kwargs.get("sliding_window")
    packing = kwargs.get(PACKING_KEYWORD)
    if packing is not None:
        if window is not None:  # never packed (packed.rows_alone): a window is not what packing attends
            raise MarspecError("a packed forward does not attend sliding windows")
        return packing.attend(module, query, key, value, scaling), None
    if kwargs.get("softcap") is not None:
        raise MarspecError("row-by-row attention does not implement softcap")
    if attention_mask is not None and query.shape[0] != 1:
        raise MarspecError("row-by-row attention takes a mask for one sequence only (batch 1)")
    q_len, kv_len = query.shape[2], key.shape[2]
    if kernel_takes(query):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        visible = torch.arange(kv_len - q_len + 1, kv_len + 1)
        if attention_mask is None and (window is None or int(visible[-1]) <= window):
            return _kernel_rows(query[0], key[0], value[0], visible, scale), None  # row i: a prefix
        attended = []
        for i in range(q_len):
            keys, values = _row_keys(key, value, attention_mask, i, int(visible[i]), window)
            seen = torch.tensor([keys.shape[2]])
            attended.append(_kernel_rows(query[0, :, i : i + 1], keys[0], values[0], seen, scale))
        return torch.cat(attended, dim=1), None
    rows = []
    key, value = key.to(query.dtype), value.to(query.dtype)  # SDPA takes one dtype (a cache may hold fp16)
    for i in range(q_len):
        # A contiguous copy: the one-query call then sees the same layout whichever forward it is in.
        row = query[:, :, i : i + 1].contiguous()  # [B, H, 1, D]
        keys, values = _row_keys(key, value, attention_mask, i, kv_len - q_len + i + 1, window)
        rows.append(F.scaled_dot_product_attention(row, keys, values, scale=scaling, enable_gqa=True))
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


def _row_keys(
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    row: int,
    end: int,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values query row ``row`` attends: the first ``end`` positions of a chain forward, or
    those its mask row lets it see, and of those the last ``window`` (a sliding-window layer: a token
    sees itself and the ``window - 1`` before it, as transformers' sliding mask)."""
    if mask is None:
        keys, values = _prefix(key, value, end)
    else:
        keys, values = _visible(key, value, mask[0, 0, row])
    if window is not None and keys.shape[2] > window:
        keys, values = keys[:, :, -window:], values[:, :, -window:]
    return keys, values


@functools.cache
def _kernel_loaded() -> bool:
    from marspec.backends.kernels import kernels_available

    return kernels_available()


def kernel_takes(query: torch.Tensor) -> bool:
    """Whether the kernels' ``attention_rows`` attends ``query`` [B, H, q, D]: one sequence of float32 rows on
    the CPU, heads a multiple of 16 up to 256 wide, and the kernel built here."""
    d = query.shape[-1]
    return (
        query.shape[0] == 1
        and query.dtype == torch.float32
        and query.device.type == "cpu"
        and d % 16 == 0
        and d <= 256
        and _kernel_loaded()
    )


def _kernel_rows(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [H, q, D] against keys and values [H_kv, kv, D], row i over its first ``visible[i]``
    positions: [1, q, H, D]."""
    from marspec.backends.kernels import ops

    return ops().attention_rows(query, keys, values, visible, float(scale)).unsqueeze(0)


def _prefix(key: torch.Tensor, value: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    return key[:, :, :end], value[:, :, :end]


def _visible(
    key: torch.Tensor, value: torch.Tensor, mask_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a mask row (``[kv]``: bool True, or additive 0, where visible) lets a query
    see, as the one sequence plain decoding would have cached: a prefix as a view, else gathered."""
    visible = mask_row if mask_row.dtype == torch.bool else mask_row == 0  # bool[kv]
    count = int(visible.sum())  # a host read per row: this attention runs on the CPU only
    if bool(visible[:count].all()):
        return _prefix(key, value, count)
    positions = visible.nonzero().squeeze(1)  # long[count]
    return key.index_select(2, positions), value.index_select(2, positions)


AttentionInterface.register(ROW_ATTENTION, row_by_row_attention)


# The attention layer kinds attended row by row: the whole prefix, or its last ``sliding_window``
# positions (each row's own window, :func:`_row_keys`).
ROW_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def layer_window(module: torch.nn.Module) -> int | None:
    """The sliding window an attention module attends (None: the whole prefix), as its forward passes it
    to the attention function: its own ``sliding_window`` (Qwen2, Qwen3, Gemma 3: None on full layers),
    else its configuration's (Mistral, Phi-3)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(getattr(module, "config", None), "sliding_window", None)


def has_sliding_layers(config: object) -> bool:
    """Whether some of a model's attention layers see a sliding window rather than the whole prefix."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    # Configurations without layer types (Mistral's) window every layer when sliding_window is set.
    return getattr(config, "sliding_window", None) is not None or bool(
        getattr(config, "use_sliding_window", 0)
    )


def check_row_attention(model: PreTrainedModel) -> None:
    """Refuse a model with attention layers of a kind not attended row by row (chunked, linear, ...)."""
    kinds = set(getattr(model.config, "layer_types", None) or ()) - ROW_LAYER_TYPES
    if kinds:
        raise MarspecError(
            f"{type(model).__name__} has attention layers of kinds {', '.join(sorted(kinds))}, which a "
            "quantised (int8, q4k or int4) target does not support here: use target_quant='none'"
        )


def use_row_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to :func:`row_by_row_attention` (after :func:`check_row_attention`)."""
    check_row_attention(model)
    model.set_attn_implementation(ROW_ATTENTION)
