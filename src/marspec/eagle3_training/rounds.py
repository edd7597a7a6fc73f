"""A run's rounds: each passes over its new shard and some earlier ones, saves the head and the
optimiser's state, and logs its losses and the held-out evaluation."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from marspec.drafters.eagle3_head import Eagle3Head
from marspec.eagle3_training.head import save_head
from marspec.eagle3_training.loss import tau_estimate, ttt_loss
from marspec.eagle3_training.run_folder import RunFolder
from marspec.eagle3_training.shards import Shard, Shards

Batch = tuple[Shard, torch.Tensor]  # a shard and the rows of it one optimiser step reads


@dataclass(frozen=True)
class Schedule:
    """How a run optimises, which may change when it is resumed (the log records each round's)."""

    lr: float
    epochs: int  # passes over each round's new shard
    replay: int  # earlier shards revisited each round
    batch: int  # chunks per optimiser step
    steps: int  # training-time-test steps (draft depth)
    chunk: int  # tokens per chunk


@dataclass
class Training:
    """A head being trained in ``run``: ``to_draft`` maps each target id to its draft id (-1 outside the
    draft vocabulary); ``held_out`` is the shard evaluated on."""

    run: RunFolder
    head: Eagle3Head
    config: dict
    optimizer: torch.optim.Optimizer
    to_draft: torch.Tensor
    shards: Shards
    held_out: Shard
    schedule: Schedule

    def evaluate(self) -> dict:
        """Each step's loss and accuracy on the held-out shard, and its tau_est."""
        self.head.eval()
        with torch.no_grad():
            _, losses, accs, correct = self._loss(self.held_out, None)
        self.head.train()
        return {
            "eval_loss": [round(x, 3) for x in losses],
            "eval_acc": [round(x, 3) for x in accs],
            "eval_tau_est": round(tau_estimate(correct), 3),
        }

    def train_round(self) -> None:
        """The next round: train, save the head, the optimiser and the state, log."""
        state, schedule = self.run.state, self.schedule
        r = state["round"] + 1
        shard = self.shards.get(r)
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = schedule.lr
        train_losses, train_accs = [], []
        for data, idx in self._batches(r, shard):
            losses, accs = self._step(data, idx)
            train_losses.append(losses)
            train_accs.append(accs)
            state["tokens_trained"] += int(idx.numel()) * schedule.chunk
        state["round"] = r
        save_head(self.head, self.config, self.run.head_dir)
        torch.save(self.optimizer.state_dict(), self.run.optimizer_path)
        self.run.save_state()
        self.run.log(
            {
                "event": "train",
                "round": r,
                "tokens_trained": state["tokens_trained"],
                "seconds": round(time.perf_counter() - t0, 1),
                "lr": schedule.lr,
                "epochs": schedule.epochs,
                "replay": schedule.replay,
                "batch": schedule.batch,
                "loss": _column_means(train_losses),
                "acc": _column_means(train_accs),
                **self.evaluate(),
            }
        )

    def _batches(self, r: int, shard: Shard) -> list[Batch]:
        """Round ``r``'s batches: the new shard ``epochs`` times, and ``replay`` earlier ones once (shard
        0 is held out), each in a shuffled order seeded by the round."""
        schedule = self.schedule
        pick = random.Random(r)
        passes = [shard] * schedule.epochs + [
            self.shards.get(pick.randint(1, r - 1)) for _ in range(schedule.replay) if r > 1
        ]
        batches: list[Batch] = []
        for data in passes:
            order = torch.randperm(
                data["tokens"].shape[0], generator=torch.Generator().manual_seed(pick.randrange(2**31))
            )
            batches += [(data, order[s : s + schedule.batch]) for s in range(0, len(order), schedule.batch)]
        return batches

    def _step(self, data: Shard, idx: torch.Tensor) -> tuple[list[float], list[float]]:
        """One optimiser step on the rows ``idx`` of ``data``; each draft step's loss and accuracy."""
        loss, losses, accs, _ = self._loss(data, idx)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.optimizer.step()
        return losses, accs

    def _loss(self, data: Shard, idx: torch.Tensor | None):
        """:func:`ttt_loss` on the rows ``idx`` of ``data`` (None: all of them)."""
        rows = slice(None) if idx is None else idx
        return ttt_loss(
            self.head,
            data["tokens"][rows].long(),
            data["states"][rows],
            data["top_ids"][rows],
            data["top_lp"][rows],
            self.to_draft,
            self.schedule.steps,
        )


def _column_means(rows: list[list[float]]) -> list[float]:
    """The mean of each column of ``rows`` (each step's mean over a round's batches), rounded."""
    return [round(sum(c) / len(c), 3) for c in zip(*rows, strict=True)]
