"""The training curve of EAGLE-3 head runs (``python -m marspec.eagle3_training``): held-out tau_est and loss
against tokens trained, one line per run, from each run's ``log.jsonl``.

    python benchmarks/eagle3_curve.py RUN_OR_LOG [RUN_OR_LOG ...] --out curve.png

Each argument is a run folder or its ``log.jsonl`` (docs/results/eagle3-training/ keeps the logs of the
runs in docs/results.md). Prints one markdown row per round and writes the plot.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from _common import script_parser  # this folder's shared helpers


def rounds(source: Path) -> list[dict]:
    """The held-out evaluation of every round of a run (round 0: before training), in order."""
    log = source / "log.jsonl" if source.is_dir() else source
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("event") in ("eval", "train") and "eval_tau_est" in e]


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or their log.jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="the plot to write (.png)")
    args = parser.parse_args()
    figure, (tau_axis, loss_axis) = plt.subplots(1, 2, figsize=(11, 4))
    print("| run | round | tokens trained | lr | held-out accuracy per step | tau_est |")
    print("|---|---|---|---|---|---|")
    for source in args.runs:
        name = source.stem if source.is_file() else source.name
        evaluated = rounds(source)
        tokens = [e["tokens_trained"] for e in evaluated]
        tau_axis.plot(tokens, [e["eval_tau_est"] for e in evaluated], marker=".", label=name)
        loss_axis.plot(tokens, [e["eval_loss"][0] for e in evaluated], marker=".", label=f"{name}, step 1")
        for e in evaluated:
            accuracy = " / ".join(f"{a:.3f}" for a in e["eval_acc"])
            cells = [name, e["round"], f"{e['tokens_trained']:,}", e.get("lr", ""), accuracy]
            print("| " + " | ".join(map(str, cells)) + f" | {e['eval_tau_est']:.3f} |")
    tau_axis.set(xlabel="tokens trained (with repeats)", ylabel="held-out tau_est", title="tau_est")
    loss_axis.set(xlabel="tokens trained (with repeats)", ylabel="held-out loss", title="first step's loss")
    for axis in (tau_axis, loss_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
