r"""The engines table (issue 57, item 5; issue 67, item 5): llama.cpp plain and speculative against marspec
plain, strict and MARS as a user gets it (no precision named: on a CPU with AVX-512 VNNI the q4k engine,
the packaged GGUF's own Q4_K weights, target and draft; ``marspec.precision``), on one machine and the
same prompts, with each process's own peak memory and the default pair's model cache on disk.

The demo's prompts (``marspec.demo.DEMO_PROMPTS``) through the target's chat template, greedy,
``--max-new-tokens`` each. marspec's rows are ``marspec demo --json`` runs, one process each: "default"
names no precision (the ``marspec.Decoder()`` defaults), "int4" is the 4-bit pair (``--target-quant int4
--draft-quant int4``, the old laptop pair; not run unless named in ``--only``). llama.cpp's are
benchmarks/llama_cpp_engine.py in an environment with llama-cpp-python (no marspec dependency), on the
pair's own packaged Q4_K_M GGUFs, fed the very token ids marspec encodes. Peak memory is each process's own
VmHWM. Tokens per second (per-prompt means, as the demo's) count the prompt's prefill, as marspec's
statistics do. The machine's load average is recorded before and after: ratios inside one run are what
count. With ``--rounds N`` the engines run N times in turn, llama.cpp first in odd rounds and last in even
ones, so that a drift of a shared machine between them does not land on one side of every ratio: each
row's tok/s is then its median over the rounds, and each round's ratio to llama.cpp's plain rate in that
round is kept beside it (the table gives their median and range).

    python benchmarks/engines.py --llama-python .venv-llamacpp/bin/python \
        --out docs/results/engines-2026-12-02.json
    python benchmarks/engines.py --llama-python .venv-llamacpp/bin/python --only llama.cpp,default \
        --rounds 3 --out engines-rounds.json

A timing: run it alone on the machine (``--only`` picks rows to rerun: llama.cpp,default,int8,int4;
"int8" is the int8 target with torch's 4-bit draft, the default where the Q4_K kernel does not run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import add_threads, machine, script_parser, write_json  # this folder's shared helpers

from marspec.demo import DEMO_PROMPTS
from marspec.eval.peak_memory import run_measured
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, get_spec, resolve_model_dir
from marspec.models.cache import WEIGHTS_FILE, held_gguf
from marspec.models.int4_cache import int4_model_file
from marspec.models.int8_store import int8_model_file
from marspec.models.tokenizers import read_tokenizer
from marspec.precision import choose_draft_quant, choose_precision
from marspec.prompting import encode_prompt

HERE = Path(__file__).resolve().parent
MARSPEC_ROWS = {
    "default": [],
    "int8": ["--target-quant", "int8", "--draft-quant", "int4"],
    "int4": ["--target-quant", "int4", "--draft-quant", "int4"],
}


def gguf_of(name: str, scratch: Path) -> Path:
    """The model's packaged GGUF: the one its cache folder keeps, else assembled from its packages."""
    held = held_gguf(resolve_model_dir(name))
    if held is not None:
        return held
    out = scratch / f"{name}.gguf"
    get_spec(name).write_gguf(out)
    return out


def default_pair_cache() -> dict[str, Any]:
    """The default pair's model cache on disk: each folder whole (``du``: it may hold files of other
    precisions or older versions) and the files the default engines read (the target's and the draft's
    stores of the forms ``marspec.precision`` picks here, configuration and tokenizer)."""
    cpu = torch.device("cpu")
    target_form = choose_precision(DEFAULT_TARGET, "auto", "auto", cpu).target_quant
    draft_folder = resolve_model_dir(DEFAULT_DRAFT)
    draft_file = (
        int8_model_file(draft_folder, "q4k-draft")
        if choose_draft_quant("auto", cpu) == "q4k"
        else int4_model_file(draft_folder, torch.float32, int8_embedding=True)
    )
    target_file = int8_model_file(resolve_model_dir(DEFAULT_TARGET), target_form)
    engine_files = {DEFAULT_TARGET: target_file, DEFAULT_DRAFT: draft_file}
    out: dict[str, Any] = {}
    for name, engine_file in engine_files.items():
        folder = resolve_model_dir(name)
        files = {str(p.relative_to(folder)): p.stat() for p in sorted(folder.rglob("*")) if p.is_file()}
        weights = {WEIGHTS_FILE} | {f for f in files if f.endswith(".gguf")}
        read = [f for f in files if "/" not in f and f not in weights]
        read.append(str(engine_file.relative_to(folder)))
        out[name] = {
            "folder": str(folder),
            "du_bytes": sum(st.st_blocks * 512 for st in files.values()),
            "files": {f: st.st_size for f, st in files.items()},
            "read_by_default": read,
            "read_by_default_bytes": sum(files[f].st_size for f in read),
        }
    return out


def llama_cpp_rows(python: str, threads: int, n: int, k: int) -> dict[str, Any]:
    tokenizer = read_tokenizer(DEFAULT_TARGET)
    prompts = [encode_prompt(tokenizer, text, True, DEFAULT_TARGET).tolist() for _, text in DEMO_PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        spec = {
            "target": str(gguf_of(DEFAULT_TARGET, scratch)),
            "draft": str(gguf_of(DEFAULT_DRAFT, scratch)),
            "prompts": prompts,
            "max_new_tokens": n,
            "threads": threads,
            "k": k,
            "eos": list(get_spec(DEFAULT_TARGET).eos_token_ids),
        }
        (scratch / "spec.json").write_text(json.dumps(spec))
        out = subprocess.run(
            [python, str(HERE / "llama_cpp_engine.py"), str(scratch / "spec.json")],
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        raise SystemExit(f"llama.cpp run failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    plain = {r["prompt"]: r["tokens"] for r in result["runs"] if r["mode"] == "plain"}
    rows = {}
    for mode in ("plain", "speculative"):
        runs = [r for r in result["runs"] if r["mode"] == mode]
        rows[f"llama.cpp Q4_K_M {mode}"] = {
            "tokens_per_s": statistics.mean(r["new_tokens"] / r["wall_s"] for r in runs),  # as the demo's
            "same_as_plain": sum(r["tokens"] == plain[r["prompt"]] for r in runs),
            "acceptance": (
                sum(r["accepted"] for r in runs) / sum(r["drafted"] for r in runs)
                if mode != "plain"
                else None
            ),
            "peak_gib": result["peak_gib"] if mode != "plain" else result["peak_gib_target_only_loaded"],
            "runs": runs,
            "build": result["build"],
        }
    return rows


def marspec_rows(name: str, flags: list[str], threads: int, n: int) -> dict[str, Any]:
    argv = ["demo", "--max-new-tokens", str(n), "--threads", str(threads), "--json", *flags]
    measured = run_measured(argv)
    if measured.returncode != 0:
        raise SystemExit(f"marspec {' '.join(argv)} failed:\n{measured.stderr[-3000:]}")
    summaries = json.loads(measured.stdout.strip().splitlines()[-1])
    return {
        f"marspec {name} {s['method']}": {
            "tokens_per_s": s["tokens_per_s"],
            "tau": s["tau"],
            "same_as_plain": s["same_as_plain"],
            "peak_gib": measured.peak_gib,
            "process_wall_s": measured.wall_s,
        }
        for s in summaries
    }


LLAMA_PLAIN = "llama.cpp Q4_K_M plain"


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per engine from several rounds' rows: its median tok/s, each round's tok/s and (where the
    round has llama.cpp's plain row) its ratio to that round's llama.cpp plain rate, the largest peak
    memory; the rest of the row (outputs, tau, ...) from its first round."""
    combined: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        present = [r for r in rounds if key in r]
        rates = [r[key]["tokens_per_s"] for r in present]
        ratios = [
            r[key]["tokens_per_s"] / r[LLAMA_PLAIN]["tokens_per_s"] for r in present if LLAMA_PLAIN in r
        ]
        peaks = [r[key]["peak_gib"] for r in present if r[key].get("peak_gib") is not None]
        combined[key] = {
            **present[0][key],
            "tokens_per_s": statistics.median(rates),
            "rounds_tokens_per_s": rates,
            "rounds_vs_llama_plain": ratios,
            "peak_gib": max(peaks) if peaks else None,
        }
    return combined


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python (omit: no llama.cpp rows)")
    add_threads(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="llama.cpp's draft length")
    parser.add_argument("--only", default="llama.cpp,default,int8")
    parser.add_argument("--rounds", type=int, default=1, help="run the engines this many times in turn")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    only = args.only.split(",")
    load_before = os.getloadavg()
    rows: dict[str, Any] = {}
    if args.out and args.out.exists():
        rows = json.loads(args.out.read_text())["rows"]  # rows not rerun are kept
    runs = [name for name in MARSPEC_ROWS if name in only]
    if "llama.cpp" in only and args.llama_python:
        runs.insert(0, "llama.cpp")
    rounds: list[dict[str, Any]] = []
    for number in range(args.rounds):
        this_round: dict[str, Any] = {}
        rounds.append(this_round)
        for name in runs if number % 2 == 0 else reversed(runs):
            n = args.max_new_tokens
            if name == "llama.cpp":
                this_round.update(llama_cpp_rows(args.llama_python, args.threads, n, args.k))
            else:
                this_round.update(marspec_rows(name, MARSPEC_ROWS[name], args.threads, n))
            if args.out:  # each finished row is kept, should a later one fail
                write_json(args.out, {"rows": {**rows, **combine_rounds(rounds)}})
    rows.update(combine_rounds(rounds))
    base = rows.get(LLAMA_PLAIN, {}).get("tokens_per_s")
    print("| engine | tok/s (mean of prompts) | vs llama.cpp plain | same as its plain | peak memory |")
    print("|---|---|---|---|---|")
    for key, r in rows.items():
        ratio = "—" if base is None else f"{r['tokens_per_s'] / base:.2f}x"
        if len(r.get("rounds_vs_llama_plain", [])) > 1:  # the rounds' own ratios: median and range
            each = r["rounds_vs_llama_plain"]
            ratio = f"{statistics.median(each):.2f}x ({min(each):.2f}-{max(each):.2f})"
        peak = "—" if r.get("peak_gib") is None else f"{r['peak_gib'] * 2**30 / 1e9:.2f} GB"
        same = f"{r['same_as_plain']}/{len(DEMO_PROMPTS)}"
        print(f"| {key} | {r['tokens_per_s']:.2f} | {ratio} | {same} | {peak} |")
    cache = default_pair_cache()
    for name, c in cache.items():
        read, whole = c["read_by_default_bytes"] / 1e9, c["du_bytes"] / 1e9
        print(f"{name}: {read:.2f} GB read by the default engines, its cache folder {whole:.2f} GB")
    if args.out:
        meta = {
            **machine(),
            "threads": args.threads,
            "max_new_tokens": args.max_new_tokens,
            "k": args.k,
            "rounds": args.rounds,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "command": " ".join(["python", *sys.argv]),
        }
        write_json(args.out, {"meta": meta, "rows": rows, "default_pair_cache": cache})
    return 0


if __name__ == "__main__":
    sys.exit(main())
