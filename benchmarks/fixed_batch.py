"""The fixed-shape path with a batch dimension on a device (issue 69's GPU half): B sequences' forwards as
one forward of [B, m] rows, captured as one CUDA graph per (batch bucket, query size) and replayed
(:mod:`marspec.backends.fixed_batch`), at 1, 4, 16 and 64 sequences.

The models are benchmarks/device_loop_cost.py's: random weights of the default pair's sizes (Qwen2.5-Coder
1.5B and 0.5B shapes, the 151,936-token vocabulary), the target made decisive so that a copy of it as the
draft accepts (almost) every draft, saved and loaded by path through ``Decoder`` with ``graphs="on"``.
Two parts, each written to the JSON file when done:

1. **forwards**: the target's batched forward at B sequences x m rows (m = 1, a plain step; m = 16, a
   verification of k = 12 drafts padded), on a cache of ``--context`` positions per sequence: median
   milliseconds (synchronised) and rows per second. On a GPU a forward reads the weights once whatever B
   is, so rows per second should grow with B until the products take over.
2. **decodes**: ``Decoder.generate_many`` of B prompts (B = 1, 4, 16, 64) at ``max_batch`` B, plain and
   strict (the copy draft), against the same prompts decoded one at a time: aggregate tokens per second,
   each sequence's speed against its solo speed, and how many answers differ from their solo ones
   (batched bf16 products may round by the batch: the line ``batching_note`` prints).

    python benchmarks/fixed_batch.py --device cuda --json fixed-batch.json   # an H200: ~2-3 minutes
    python benchmarks/fixed_batch.py --device cpu --small --dtype fp32       # checks the script on a CPU

On a lent GPU it runs as the third part of benchmarks/gpu_check.py.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import device_sync, machine, median_ms, script_parser, write_json
from device_loop_cost import FULL, FULL_VOCAB, PROMPT, SMALL, build_model, load_tokenizer, models_report, save

from marspec.api import Decoder
from marspec.backends.fixed import QUERY_SIZES
from marspec.backends.fixed_batch import FixedBatch, SlotRows

BATCHES = (1, 4, 16, 64)
ROWS = (1, 16)  # a plain step's rows and a verification's (k = 12 drafts and the pending token, padded)
SOLO = 4  # prompts also decoded one at a time: the solo speed and the answers compared


def forward_costs(
    decoder: Decoder, batches, context: int, repeats: int, device: torch.device
) -> tuple[list[dict], list[dict]]:
    """Median ms of the target's batched forward at each B x m, every slot holding ``context`` positions."""
    batch = FixedBatch(decoder.target)
    slots = [batch.claim() for _ in range(max(batches))]
    ids = torch.Generator().manual_seed(0)
    chunk = QUERY_SIZES[-1]
    for start in range(0, context, chunk):  # every slot's cache filled, a chunk per forward
        n = min(chunk, context - start)
        batch.run(
            [
                SlotRows(
                    s, start, torch.randint(0, decoder.target.vocab_size, (n,), generator=ids).to(device)
                )
                for s in slots
            ]
        )
    rows = []
    for b in batches:
        for m in ROWS:
            calls = [
                SlotRows(
                    s, context, torch.randint(0, decoder.target.vocab_size, (m,), generator=ids).to(device)
                )
                for s in slots[:b]
            ]
            # The host's lengths are not advanced: every call writes the same positions, as a verification
            # whose drafts are all rejected would.
            ms = median_ms(lambda calls=calls: batch.run(calls), repeats, warmup=2, device=device)
            rows.append({"sequences": b, "rows": m, "ms": ms, "rows_per_s": b * m / ms * 1000})
            print(f"forward  B={b:3d} m={m:3d}: {ms:8.2f} ms  {b * m / ms * 1000:10.0f} rows/s", flush=True)
    captures = batch.graphs.records if batch.graphs is not None else []
    return rows, [{"key": list(r.key), "passed": r.passed} for r in captures]


def decode_runs(
    decoder: Decoder, prompts: list[str], batches, rule: str, new_tokens: int, device: torch.device
) -> dict:
    """Aggregate tok/s of generate_many at each B, the first SOLO prompts decoded alone for comparison."""
    options = dict(rule=rule, max_new_tokens=new_tokens, chat=False, reuse_prefix=False)
    for b in batches:  # captures happen here, untimed
        decoder.generate_many(prompts[:b], max_batch=b, **{**options, "max_new_tokens": 8})
    solo_tokens, solo_s = [], []
    for prompt in prompts[:SOLO]:
        device_sync(device)
        began = time.perf_counter()
        result = decoder.generate(prompt, **options)
        device_sync(device)
        solo_s.append(time.perf_counter() - began)
        solo_tokens.append(result.token_ids)
    solo_rate = statistics.mean(len(t) / s for t, s in zip(solo_tokens, solo_s, strict=True))
    out: dict = {"rule": rule, "solo_tok_s": solo_rate, "batches": []}
    for b in batches:
        device_sync(device)
        began = time.perf_counter()
        results = decoder.generate_many(prompts[:b], max_batch=b, **options)
        device_sync(device)
        elapsed = time.perf_counter() - began
        tokens = sum(len(r.token_ids) for r in results)
        differ = sum(r.token_ids != t for r, t in zip(results, solo_tokens, strict=False))
        row = {
            "sequences": b,
            "tok_s": tokens / elapsed,
            "per_sequence_vs_solo": tokens / elapsed / b / solo_rate,
            "vs_one_sequence": None,
            "answers_compared": min(b, SOLO),
            "answers_differ": differ,
            "seconds": elapsed,
        }
        out["batches"].append(row)
        print(
            f"decode {rule:6s} B={b:3d}: {row['tok_s']:9.1f} tok/s, each {row['per_sequence_vs_solo']:.2f}x "
            f"solo ({solo_rate:.1f} tok/s), {differ} of {row['answers_compared']} answers differ",
            flush=True,
        )
    one = out["batches"][0]["tok_s"]
    for row in out["batches"]:
        row["vs_one_sequence"] = row["tok_s"] / one
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--small", action="store_true", help="tiny models, to check the script on a CPU")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per answer (default 64)")
    parser.add_argument("--context", type=int, default=128, help="cached positions for the forwards part")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per size (default 10)")
    parser.add_argument("--json", type=Path, default=Path("fixed_batch.json"), help="where to write")
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    device = torch.device(args.device)
    shapes = SMALL if args.small else FULL
    tokenizer = load_tokenizer(None)
    vocab = len(tokenizer) if args.small else FULL_VOCAB
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    report: dict = {
        **models_report(device, args.dtype, args.small, shapes, vocab),
        "new_tokens": args.new_tokens,
        "context": args.context,
        **machine(),
    }

    def write(part: str) -> None:
        report["parts_done"] = [*report.get("parts_done", []), part]
        report["total_s"] = time.perf_counter() - begun
        write_json(args.json, report)
        print(f"[{report['total_s']:.0f}s] {part} written to {args.json}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="marspec-fixed-batch-") as tmp:
        target = build_model(shapes["target"], vocab, 0, True, tokenizer, device)
        target_dir = save(target, tokenizer, Path(tmp) / "target", dtype)
        del target
        common = dict(dtype=args.dtype, device=args.device, lookup=False, draft_quant="none", graphs="on")
        plain = Decoder(str(target_dir), None, **common)
        copy = Decoder(plain.target, str(target_dir), draft_confidence=0.0, **common)
        report["build_load_s"] = time.perf_counter() - begun

        report["forwards"], report["captures"] = forward_costs(
            plain, BATCHES, args.context, args.repeats, device
        )
        write("forwards")
        prompts = [f"{PROMPT}# case {i}\n" for i in range(max(BATCHES))]
        report["decodes"] = [
            decode_runs(plain, prompts, BATCHES, "plain", args.new_tokens, device),
            decode_runs(copy, prompts, BATCHES, "strict", args.new_tokens, device),
        ]
        write("decodes")
    return report


if __name__ == "__main__":
    main()
