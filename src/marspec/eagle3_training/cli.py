"""The command line: ``python -m marspec.eagle3_training [options]`` (see the package's description)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from marspec import eagle3_training
from marspec.eagle3_training.corpus import Document, corpus, draft_vocabulary
from marspec.eagle3_training.head import head_config, initialise_head, new_head
from marspec.eagle3_training.rounds import Schedule, Training
from marspec.eagle3_training.run_folder import FIXED, RunFolder
from marspec.eagle3_training.shards import Shards, ShardShape
from marspec.models.eagle3 import default_layers

if TYPE_CHECKING:
    from marspec.backends.hf import HFCausalLM
    from marspec.drafters.eagle3_head import Eagle3Head


def main(argv: list[str] | None = None) -> None:
    """Train (or go on training) the run ``--run`` for ``--rounds`` rounds (0: until stopped)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = open_run(args)
    target, layers = load_target(args.target, args.dtype)
    docs = corpus(folder=args.corpus)
    if not run.state:
        run.begin(fixed_settings(args), draft_vocabulary(target, docs, args.draft_vocab))
    training = prepare_training(args, run, target, layers, docs)
    if run.state["round"] == 0:
        run.log({"event": "eval", "round": 0, "tokens_trained": 0, **training.evaluate()})
    while not args.rounds or run.state["round"] < args.rounds:
        training.train_round()


def prepare_training(
    args: argparse.Namespace,
    run: RunFolder,
    target: HFCausalLM,
    layers: tuple[int, ...],
    docs: list[Document],
) -> Training:
    """The head (as the run left it, or new), its optimiser, the run's shards and the held-out one."""
    draft_ids = torch.tensor(run.state["draft_ids"])
    config = head_config(target.model.config.to_dict(), len(draft_ids), args.intermediate, layers)
    head = new_head(target, config, layers)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr)
    resume_or_initialise(run, head, optimizer, target, draft_ids)
    for p in target.model.parameters():  # the target's embedding is read, never trained
        p.requires_grad_(False)
    shards = Shards(run, target, layers, docs, shard_shape(args))
    mapping = to_draft(draft_ids, target.vocab_size)
    return Training(run, head, config, optimizer, mapping, shards, shards.get(0), schedule(args))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m marspec.eagle3_training", description=(eagle3_training.__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--run", type=Path, default=None, help="run folder, resumed if it exists (default: CACHE/eagle3-run)"
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument(
        "--corpus", type=Path, default=None, help="a folder of text files to train on (default: see above)"
    )
    parser.add_argument("--dtype", default="bf16", help="the target's dtype while collecting")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per training sequence")
    parser.add_argument("--shard-chunks", type=int, default=8, help="chunks per shard (one round)")
    parser.add_argument("--per-doc", type=int, default=2, help="most chunks taken from one document")
    parser.add_argument("--top", type=int, default=8, help="target log-probabilities kept per position")
    parser.add_argument("--draft-vocab", type=int, default=8000)
    parser.add_argument("--intermediate", type=int, default=2048, help="the head's MLP width")
    parser.add_argument("--steps", type=int, default=4, help="training-time-test steps (draft depth)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--batch", type=int, default=1, help="chunks per optimiser step")
    parser.add_argument("--epochs", type=int, default=2, help="passes over each round's new shard")
    parser.add_argument("--replay", type=int, default=1, help="earlier shards revisited each round")
    parser.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: never)")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def fixed_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a run keeps for its life (:data:`~marspec.eagle3_training.run_folder.FIXED`)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k in FIXED}


def shard_shape(args: argparse.Namespace) -> ShardShape:
    return ShardShape(chunks=args.shard_chunks, chunk=args.chunk, per_doc=args.per_doc, top=args.top)


def schedule(args: argparse.Namespace) -> Schedule:
    return Schedule(
        lr=args.lr,
        epochs=args.epochs,
        replay=args.replay,
        batch=args.batch,
        steps=args.steps,
        chunk=args.chunk,
    )


def open_run(args: argparse.Namespace) -> RunFolder:
    """The run folder ``--run`` (default: in marspec's cache), refused if begun with other settings."""
    from marspec.models.cache import cache_dir

    run = RunFolder(args.run if args.run is not None else cache_dir() / "eagle3-run")
    run.check_settings(fixed_settings(args))
    return run


def load_target(name: str, dtype: str) -> tuple[HFCausalLM, tuple[int, ...]]:
    """The target, keeping the hidden states of the layers a head reads (returned with it)."""
    from marspec.api import load_lm
    from marspec.models import parse_dtype

    target, _ = load_lm(name, parse_dtype(dtype))
    layers = default_layers(target.num_layers)
    target.capture_hidden_states(layers)
    return target, layers


def resume_or_initialise(
    run: RunFolder,
    head: Eagle3Head,
    optimizer: torch.optim.Optimizer,
    target: HFCausalLM,
    draft_ids: torch.Tensor,
) -> None:
    """The head and the optimiser as the run's last round left them, or a new head's weights."""
    if not (run.head_dir / "model.safetensors").exists():
        initialise_head(head, target, draft_ids)
        return
    from safetensors.torch import load_file

    head.load_state_dict(load_file(str(run.head_dir / "model.safetensors")), strict=False)
    optimizer.load_state_dict(torch.load(run.optimizer_path, weights_only=True))


def to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each target id's draft id, -1 outside the draft vocabulary."""
    mapping = torch.full((vocab_size,), -1, dtype=torch.long)
    mapping[draft_ids] = torch.arange(len(draft_ids))
    return mapping
