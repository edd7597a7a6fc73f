"""What one EAGLE-3 head step costs against one target step, on this machine.

The target (by name, fp32 by default) and a head of the published shape for it with random weights
(the target's width and attention shape; ``--intermediate`` and ``--draft-vocab`` as a published head for
it would have them, or as the head trained here has them) each take single-token steps after a prompt
of ``--context`` tokens; the medians of ``--repeats`` steps are compared. The head's step is what a
drafted token costs (fc is paid once per verification, counted here in every step: an upper bound).

    OMP_NUM_THREADS=2 python benchmarks/eagle3_head_cost.py --json out.json
"""

from __future__ import annotations

from pathlib import Path

import torch
from _common import machine, median_ms, script_parser, write_json  # this folder's shared helpers

from marspec.api import load_lm
from marspec.drafters.eagle3_head import Eagle3Head, HeadCache
from marspec.eagle3_training.head import head_config, spec_of
from marspec.models import DEFAULT_TARGET, parse_dtype
from marspec.models.eagle3 import default_layers


def median_step(step, repeats: int) -> float:
    """Median wall seconds of ``step``."""
    return median_ms(step, repeats) / 1000


def head_step(
    head: Eagle3Head, cache: HeadCache, state: torch.Tensor, token: torch.Tensor, context: int
) -> None:
    """One drafted token: fc of a feature, the decoder layer over the cache, the draft logits."""
    with torch.inference_mode():
        cache.step(token, head.fc(state))
    cache.rollback(context)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--intermediate", type=int, nargs="+", default=[8960, 2048])
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[32000, 8000])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dtype = parse_dtype(args.dtype)
    target, _ = load_lm(args.target, dtype, prepack=True)
    prompt = torch.randint(0, 10_000, (args.context,), generator=torch.Generator().manual_seed(0))
    target.forward(prompt, last_only=True)
    token = prompt[:1]

    def target_step() -> None:
        target.forward(token)
        target.rollback(args.context)

    rows = [{"model": "target", "seconds": median_step(target_step, args.repeats)}]
    layers = default_layers(target.num_layers)
    config_t = target.model.config.to_dict()
    for inter, vocab in zip(args.intermediate, args.draft_vocab, strict=True):
        config = head_config(config_t, vocab, inter, layers)
        head = Eagle3Head(spec_of(config), len(layers), target.model.get_input_embeddings())
        head = head.to(dtype).eval().requires_grad_(False)
        cache = HeadCache(head)
        with torch.inference_mode():
            features = head.fc(torch.randn(args.context, len(layers) * target.hidden_size, dtype=dtype))
            cache.step(prompt, features)
        state = torch.randn(1, len(layers) * target.hidden_size, dtype=dtype)
        seconds = median_step(
            lambda h=head, c=cache, x=state: head_step(h, c, x, token, args.context), args.repeats
        )
        rows.append({"model": f"head mlp {inter}, vocab {vocab}", "seconds": seconds})
    base = rows[0]["seconds"]
    for row in rows:
        row["of_target_step"] = round(row["seconds"] / base, 3)
        share = row["of_target_step"]
        print(f"{row['model']:>28}: {row['seconds'] * 1000:8.2f} ms  ({share:.3f} of a target step)")
    if args.json:
        write_json(args.json, {**machine(), "context": args.context, "rows": rows})


if __name__ == "__main__":
    main()
