"""EAGLE-3's training-time test: the head's loss against the target's distribution over its draft steps,
each step reading the head's own output of the step before (what it sees when drafting)."""

from __future__ import annotations

import math

import torch

from marspec.drafters.eagle3_head import Eagle3Head


def ttt_loss(
    head: Eagle3Head,
    tokens: torch.Tensor,  # long[B, T]
    states: torch.Tensor,  # [B, T, layers x H]
    top_ids: torch.Tensor,  # long[B, T, K] target ids of the target's top K at each position
    top_lp: torch.Tensor,  # [B, T, K]
    to_draft: torch.Tensor,  # long[V]: draft id of each target id, -1 outside the draft vocabulary
    steps: int,
) -> tuple[torch.Tensor, list[float], list[float], torch.Tensor]:
    """EAGLE-3's training-time test over ``steps`` steps. Returns the mean loss, each step's loss and
    accuracy, and bool[B, R, steps]: whether each row's step chose the target's top token."""
    b, t = tokens.shape
    rows = t - 1 - steps  # rows whose every step has a token to read and a label
    feature = head.fc(states[:, :rows].float())
    positions = torch.arange(rows).expand(b, rows)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    group = head.num_heads // head.num_kv_heads
    losses, accs, correct = [], [], []
    total = torch.zeros(())
    for j in range(steps):
        x, residual = head.layer_input(tokens[:, 1 + j : 1 + j + rows], feature)
        q, k, v = head.project(x, positions + j)
        keys.append(k.repeat_interleave(group, dim=1))
        values.append(v.repeat_interleave(group, dim=1))
        scale = 1.0 / math.sqrt(head.head_dim)
        first = torch.einsum("bhqd,bhkd->bhqk", q, keys[0]) * scale
        first = first.masked_fill(~causal, float("-inf"))
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # [B, H, R, 1] each
        weights = torch.softmax(torch.cat([first, *diag], dim=-1), dim=-1)
        attended = weights[..., :rows] @ values[0]
        for i, vv in enumerate(values[1:]):
            attended = attended + weights[..., rows + i : rows + i + 1] * vv
        stream = head.layer_output(attended, residual)
        logits = head.logits(stream)  # [B, R, Vd]
        # The label of row p at step j: the target's distribution at position p + 1 + j.
        ids = top_ids[:, 1 + j : 1 + j + rows]  # [B, R, K]
        probs = top_lp[:, 1 + j : 1 + j + rows].float().exp()
        draft_ids = to_draft[ids.long()]  # [B, R, K], -1 outside
        inside = draft_ids >= 0
        probs = probs * inside
        mass = probs.sum(-1, keepdim=True)
        usable = inside[..., 0]  # rows whose target top choice the head can draft
        probs = probs / mass.clamp_min(1e-9)
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, draft_ids.clamp_min(0))  # [B, R, K]
        loss_rows = -(probs * picked).sum(-1)
        loss = (loss_rows * usable).sum() / usable.sum().clamp_min(1)
        total = total + loss
        hit = (logits.argmax(-1) == draft_ids[..., 0]) & usable
        losses.append(float(loss.detach()))
        accs.append(float(hit.sum()) / max(1, int(usable.sum())))
        correct.append(hit)
        feature = stream
    return total / steps, losses, accs, torch.stack(correct, dim=-1)


def tau_estimate(correct: torch.Tensor) -> float:
    """1 + the mean number of leading steps whose top choice is the target's (bool[..., steps])."""
    leading = torch.cumprod(correct.long(), dim=-1).sum(-1)
    return 1.0 + float(leading.float().mean())
