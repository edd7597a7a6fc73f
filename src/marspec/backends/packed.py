"""One forward over the new tokens of several sequences, each sequence with its own KV cache.

A CPU forward of the int8 target is bound by reading its weights: scoring 40 rows costs little more than
scoring one, so sequences decoded together share that read. Here the rows of several sequences (one
verification of each, a chunk of a new prompt, a draft step) are packed into one forward of one row
sequence: every linear layer, norm and embedding runs over all of them at once, and attention, the one
place where rows of one sequence meet, attends each sequence's rows against that sequence's own cache.

Exactness: this needs a model whose rows are computed alone (:func:`rows_alone`): row-wise int8 or 4-bit
linear layers, which give a row the same bits whatever else is in the product, and row-by-row attention
(:mod:`marspec.backends.row_attention`), which attends each row by the one-query call its own forward
makes. A sequence's rows then get the same logits and cache entries, bit for bit, as its own forward of
the same tokens would: what it decodes does not depend on which sequences share its forwards. Other
models are never packed (:mod:`marspec.batch` runs their forwards one sequence at a time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from marspec.backends import kernels
from marspec.backends.hf import HFCausalLM
from marspec.backends.hf import rows_alone as rows_alone  # the decision packing needs, read here too
from marspec.backends.row_attention import PACKING_KEYWORD, kernel_takes, row_by_row_attention


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a packed forward: rows ``start .. end - 1``, appended to ``lm``'s cache."""

    lm: HFCausalLM
    start: int
    end: int


@dataclass(frozen=True)
class Packing:
    """Where each sequence's rows are in a packed forward. Passed through the model's forward to its
    attention function (transformers hands keyword arguments down to it), which calls :meth:`attend`."""

    segments: tuple[Segment, ...]
    starts: torch.Tensor  # long[S + 1]: where each sequence's rows start, then the rows' count
    visible: torch.Tensor  # long[rows]: the positions each row sees (its own position + 1)

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,  # [1, H, T, D]: the packed rows
        key: torch.Tensor,  # [1, H_kv, T, D]: their keys, not yet cached
        value: torch.Tensor,  # [1, H_kv, T, D]
        scaling: float | None,
    ) -> torch.Tensor:
        """Append each segment's keys and values to its own cache's layer and attend its rows against
        that cache, as the sequence's own forward would; returns [1, T, H, D]."""
        layer_index = module.layer_idx
        layers = [seg.lm.cache_layers[layer_index] for seg in self.segments]
        if kernel_takes(query):  # one call: every sequence's rows written to its cache and attended there
            rooms = [
                layer.room(key, value, seg.end - seg.start)
                for layer, seg in zip(layers, self.segments, strict=True)
            ]
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            rows = kernels.ops().attention_segments(
                query[0],
                key[0],
                value[0],
                [k for k, _ in rooms],
                [v for _, v in rooms],
                self.starts,
                self.visible,
                scale,
            )
            for layer, seg in zip(layers, self.segments, strict=True):
                layer.advance(seg.end - seg.start)
            return rows.unsqueeze(0)
        outputs = []
        for layer, seg in zip(layers, self.segments, strict=True):
            keys, values = layer.update(key[:, :, seg.start : seg.end], value[:, :, seg.start : seg.end])
            rows, _ = row_by_row_attention(
                module, query[:, :, seg.start : seg.end], keys, values, None, scaling=scaling
            )
            outputs.append(rows)  # [1, n, H, D]
        return torch.cat(outputs, dim=1)  # [1, T, H, D]


@torch.inference_mode()
def forward_packed(calls: Sequence[tuple[HFCausalLM, torch.Tensor, bool]]) -> list[torch.Tensor]:
    """Run the forwards ``(lm, tokens (long[n]), last_only)`` of sequences of one model as one packed
    forward; each ``lm`` must hold its own cache of that model and compute rows alone
    (:func:`rows_alone`). Returns what each ``lm.forward(tokens, last_only)`` would: float32 logits [n, V]
    or [1, V], the same bits, and leaves each cache as that forward would."""
    model = calls[0][0].model
    segments, positions, keep = [], [], []
    start = 0
    for lm, tokens, last_only in calls:
        end = start + int(tokens.shape[0])
        segments.append(Segment(lm, start, end))
        positions.append(torch.arange(lm.cached_len, lm.cached_len + end - start))
        keep.append(torch.arange(end - 1 if last_only else start, end))
        start = end
    device = calls[0][1].device
    packed = torch.cat([tokens for _, tokens, _ in calls])
    rows = torch.cat(positions).to(device)
    kept = torch.cat(keep).to(device)
    starts = torch.tensor([seg.start for seg in segments] + [start])
    packing = Packing(tuple(segments), starts, rows.cpu() + 1)
    direct = calls[0][0].direct
    began = time.perf_counter()
    try:
        if direct is not None:
            logits = direct(
                packed, rows, lambda module, q, k, v: packing.attend(module, q, k, v, module.scaling), kept
            )
        else:
            out = model(
                input_ids=packed.unsqueeze(0),
                position_ids=rows.unsqueeze(0),
                use_cache=False,
                logits_to_keep=kept,
                **{PACKING_KEYWORD: packing},
            )
            logits = out.logits[0].float()  # [kept rows, V]
    except BaseException:
        for lm, _, _ in calls:  # layers the failed forward reached hold rows no length counts
            _crop_to(lm, lm.cached_len)
        raise
    elapsed = time.perf_counter() - began
    results, row = [], 0
    for lm, tokens, last_only in calls:
        kept = 1 if last_only else int(tokens.shape[0])
        results.append(logits[row : row + kept])
        row += kept
        lm.note_appended(tokens)
        lm.clock.tick(elapsed)  # each sequence waited for the whole forward
    return results


def _crop_to(lm: HFCausalLM, length: int) -> None:
    for layer in lm.cache_layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
