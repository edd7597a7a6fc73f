"""The options several commands take, with their help text in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from marspec.defaults import (
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_K,
    DEFAULT_MARGIN,
    DEFAULT_THETA,
    MAX_K,
    SAMPLING_MARGIN,
    SAMPLING_THETA,
)

TargetOpt = Annotated[
    str,
    typer.Option("--target", help="Target model: a known name, HF folder, .gguf file or Hub id ORG/NAME."),
]
DraftOpt = Annotated[
    str,
    typer.Option(
        "--draft",
        help="Draft model name/path/Hub id, an EAGLE-3 head for the target (path/Hub id), 'ngram' for "
        "prompt lookup, or 'none'.",
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="auto (default: fp32, or the int8 engine on a CPU for a model that comes as a GGUF; see "
        "--target-quant), fp32 (the float model, exact) or bf16: half the memory, and on CPUs with "
        "AVX512-BF16 faster, but its outputs can differ from fp32's. Naming a dtype keeps the target a float "
        "model.",
    ),
]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="torch threads (default: torch's choice).")]
ThetaOpt = Annotated[
    str | None,
    typer.Option(
        "--theta",
        help="MARS's close-call threshold for --margin; 1 = strict. Default: the setting measured for your "
        f"decoding (greedy: {DEFAULT_MARGIN} {DEFAULT_THETA:g}; sampling: {SAMPLING_MARGIN} "
        f"{SAMPLING_THETA:g}; docs/results.md). 'auto': the setting `marspec calibrate` chose for this "
        "target and draft. A rival rule's parameter.",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto | cpu | cuda | cuda:N | mps: where models, caches and verification run (auto: a GPU if "
        "there is one); int8 drafts and prepacking are CPU kernels. The test suite runs on cpu; "
        "`marspec selftest` passed on cuda (H100, H200).",
    ),
]
MarginOpt = Annotated[
    str | None,
    typer.Option(
        "--margin",
        help="prob_ratio (p2/p1) | logit_ratio (the paper's z2/z1) | logit_gap (z1 - z2). Default: the "
        "measured setting's (see --theta); named without --theta, a margin takes its usual threshold "
        "(logit_ratio 0.9, logit_gap ln 2).",
    ),
]
KOpt = Annotated[
    int,
    typer.Option("--k", help=f"Most draft tokens per step (1 to {MAX_K}); drafts end early when unsure."),
]
# Unset, the draft length and stop of a generation are chosen from this machine's measured costs when
# the pair loads (marspec.draft_length); the bench and calibration keep fixed ones, to compare like for like.
CHOSEN = "Unset: chosen from this CPU's measured costs (once per pair, cached; MARSPEC_DRAFT_COSTS=off: {})."
ChosenKOpt = Annotated[
    int | None,
    typer.Option(
        "--k",
        help=f"Most draft tokens per step (1 to {MAX_K}); drafts end early when unsure. "
        + CHOSEN.format(DEFAULT_K),
        show_default=False,
    ),
]
TreeOpt = Annotated[
    str | None,
    typer.Option(
        "--tree",
        help="Token-tree drafting (greedy): candidates per depth, e.g. 2,2 also verifies the draft's "
        "runner-up at depths 1 and 2 in the same forward.",
    ),
]
DraftQuantOpt = Annotated[
    str,
    typer.Option(
        "--draft-quant",
        help="auto (default: the cheapest draft step this CPU runs: q4k where the Q4_K kernel runs, else "
        "int4), q4k, int4, int8 or none (CPU only).",
    ),
]
TargetQuantOpt = Annotated[
    str,
    typer.Option(
        "--target-quant",
        help="auto (default: on a CPU, a model that comes as a GGUF runs as q4k, its own Q4_K weights "
        "against int8 activations, where the CPU has AVX-512 VNNI, else int8; anything else none), "
        "none (the float model: with --dtype fp32, exact), q4k, int8 or int4 (CPU; smaller and faster; "
        "strict still equals plain decoding of the model that runs).",
    ),
]
DraftConfidenceOpt = Annotated[
    float,
    typer.Option("--draft-confidence", help="End a draft at a token the draft is less sure of; 0 = never."),
]
ChosenDraftConfidenceOpt = Annotated[
    float | None,
    typer.Option(
        "--draft-confidence",
        help="End a draft at a token the draft is less sure of; 0 = never. "
        + CHOSEN.format(DEFAULT_DRAFT_CONFIDENCE),
        show_default=False,
    ),
]
LookupOpt = Annotated[
    bool, typer.Option("--lookup/--no-lookup", help="Try prompt lookup before the draft model.")
]
GraphsOpt = Annotated[
    str,
    typer.Option(
        "--graphs",
        help="auto | on | off: the fixed-shape path (a fixed-capacity KV cache, forwards padded to a few "
        "sizes), captured as CUDA graphs on a CUDA device. auto: captured on CUDA, eager elsewhere; on: "
        "that path on every device (uncaptured off CUDA, the same tokens); off: eager.",
    ),
]
PrepackOpt = Annotated[
    bool,
    typer.Option(
        "--prepack/--no-prepack", help="oneDNN-prepacked linear weights: ~3x cheaper multi-token forwards."
    ),
]


TemperatureOpt = Annotated[
    float, typer.Option("--temperature", help="0 = greedy; > 0 samples (seeds shared by all methods).")
]
SamplesOpt = Annotated[
    int, typer.Option("--samples", help="Decodes per question and method (needs --temperature > 0).")
]
PlainLimitOpt = Annotated[
    int | None,
    typer.Option(
        "--plain-limit",
        help="Run plain on the first N questions only (the speed baseline); strict is the quality reference.",
    ),
]
LimitOpt = Annotated[
    int | None, typer.Option("--limit", help="First N questions of the task (default: all).")
]
OutOpt = Annotated[
    Path, typer.Option("--out", help="Results directory (resumes a run with the same config).")
]
TaskOpt = Annotated[str, typer.Option("--task", help="humaneval | gsm8k | mtbench")]
MaxNewOpt = Annotated[
    int | None, typer.Option("--max-new-tokens", help="Per turn (default: long enough to finish; 512).")
]
