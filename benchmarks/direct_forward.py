r"""The direct forward (marspec.backends.direct) against transformers' forward on the default CPU engine,
in one process, interleaved: the draft's one-token and 13-token forwards, and plain, strict and MARS
decodes of the demo's prompts. Both forwards give the same bits (tests/test_direct.py); only time
differs, so each round runs both, alternating which goes first, and the medians are compared.

    python benchmarks/direct_forward.py --out docs/results/direct-forward-2026-12-02.json

A timing: run it alone on the machine.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import add_threads, machine, median_ms, script_parser, write_json

from marspec import Decoder
from marspec.demo import DEMO_PROMPTS

RULES = ("plain", "strict", "mars")
FORMS = ("transformers", "direct")


def main() -> None:
    parser = script_parser(__doc__)
    add_threads(parser)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both forwards")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", help="where to write the JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoder = Decoder()
    models = (decoder.target, decoder.drafter.draft_model)
    if any(lm.direct is None for lm in models):
        raise SystemExit("the default engine's models do not take the direct forward on this machine")
    draft = decoder.drafter.draft_model
    context = torch.randint(100, 5000, (214,))
    samples: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for form in FORMS if round_ % 2 == 0 else FORMS[::-1]:
            for lm in models:
                lm.use_direct = form == "direct"
            draft.reset()
            draft.forward(context[:200], last_only=True)
            for rows in (1, 13):
                step = median_ms(
                    lambda rows=rows: draft.forward(context[200 : 200 + rows]),
                    repeats=10,
                    warmup=2,
                    after=lambda: draft.rollback(200),
                )
                samples.setdefault(f"{form} draft forward {rows} ms", []).append(step)
            for rule in RULES:
                tokens, seconds = 0, 0.0
                for _, prompt in DEMO_PROMPTS:
                    start = time.perf_counter()
                    result = decoder.generate(prompt, rule=rule, max_new_tokens=args.max_new_tokens)
                    seconds += time.perf_counter() - start
                    tokens += len(result.token_ids)
                samples.setdefault(f"{form} {rule} tok/s", []).append(tokens / seconds)
            print(
                round_,
                form,
                {k: round(v[-1], 2) for k, v in samples.items() if k.startswith(form)},
                flush=True,
            )
    medians = {key: statistics.median(values) for key, values in samples.items()}
    for key in sorted(medians):
        print(f"{key}: {medians[key]:.2f}")
    for what in ("draft forward 1 ms", "draft forward 13 ms"):
        ratio = medians[f"transformers {what}"] / medians[f"direct {what}"]
        print(f"{what}: transformers / direct {ratio:.3f}x")
    for rule in RULES:
        ratio = medians[f"direct {rule} tok/s"] / medians[f"transformers {rule} tok/s"]
        print(f"{rule}: direct / transformers {ratio:.3f}x")
    if args.out:
        write_json(args.out, {"meta": machine(), "args": vars(args), "samples": samples, "medians": medians})


if __name__ == "__main__":
    main()
