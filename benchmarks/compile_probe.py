"""What kernel fusion would buy beyond CUDA graphs: transformers' own greedy decoding of a random model of
the default target's size (bf16, batch 1) with a static cache, eager and under
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (fused kernels replayed as CUDA graphs: the
gpt-fast recipe), in milliseconds per token, beside the weight-read floor.

marspec's replayed fixed-shape forward runs eager's own ~1,000 kernels (exact to eager, checked bit for
bit); this measures how far fused ones would go, to decide whether a compiled path is worth its warm-up
and its own statement of exactness. Needs torch and transformers only.

    python benchmarks/compile_probe.py --device cuda --json out.json      # a lent GPU: ~1-2 minutes
    python benchmarks/compile_probe.py --device cpu --small --json out.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import transformers
from _common import script_parser, write_json  # this folder's shared helpers

LOOP_COST = Path(__file__).with_name("device_loop_cost.py")


def _loop_cost():
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_loop_cost", LOOP_COST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ms_per_token(model, ids: torch.Tensor, new_tokens: int, device: torch.device) -> float:
    """Wall ms per new token of a greedy static-cache generate, synchronised (prefill included: small)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return 1000 * (time.perf_counter() - start) / new_tokens


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny model (a CPU check of the script)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=Path("compile_probe.json"))
    args = parser.parse_args(argv)
    loop = _loop_cost()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = loop.load_tokenizer(None)
    shape = (loop.SMALL if args.small else loop.FULL)["target"]
    vocab = len(tokenizer) if args.small else loop.FULL_VOCAB
    model = loop.build_model(shape, vocab, 0, True, tokenizer, device).to(dtype)
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor([tokenizer(loop.PROMPT)["input_ids"][: loop.QWEN_PROMPT_TOKENS]], device=device)
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "new_tokens": args.new_tokens,
        "weight_gb": weight_bytes / 1e9,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }

    def write() -> None:
        write_json(args.json, report)
        print(json.dumps(report), flush=True)

    ms_per_token(model, ids, 8, device)  # warm-up
    report["eager_ms_per_token"] = ms_per_token(model, ids, args.new_tokens, device)
    write()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    begun = time.perf_counter()
    ms_per_token(model, ids, 8, device)  # compiles (prefill and decode shapes)
    ms_per_token(model, ids, 8, device)
    report["compile_warmup_s"] = time.perf_counter() - begun
    report["compiled_ms_per_token"] = ms_per_token(model, ids, args.new_tokens, device)
    write()
    return report


if __name__ == "__main__":
    main()
