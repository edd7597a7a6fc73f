"""llama.cpp's side of benchmarks/engines.py: greedy plain and speculative decoding of given prompt token
ids on two GGUFs, through llama-cpp-python's bindings of llama.cpp's C API.

Runs in its own environment (llama-cpp-python is no marspec dependency; numpy is all else it needs):

    .venv-llamacpp/bin/python benchmarks/llama_cpp_engine.py SPEC.json

SPEC.json: {"target": GGUF, "draft": GGUF, "prompts": [[ids...], ...], "max_new_tokens": N,
"threads": T, "k": K, "eos": [ids...]}. Prints one JSON object: per prompt and mode ("plain",
"speculative") the new tokens, wall seconds (prefill included, as marspec's tok/s counts it), target
forwards, and for speculative the accepted draft tokens; this process's own peak memory (VmHWM); and the
build (llama-cpp-python's version, llama.cpp's system info: the instruction sets it was built for).

Speculative decoding is llama.cpp's greedy draft-then-verify (its speculative example's scheme): the
draft proposes K tokens one at a time, the target scores the last accepted token and the K drafts in one
batch, the longest prefix agreeing with the target's argmax is kept plus the target's next token, and
both key/value caches are cut back to what was kept. The loop is Python; every forward is llama.cpp's.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp as lc
import numpy as np


class Engine:
    """One model and its context, with the position of what its key/value cache holds."""

    def __init__(
        self, path: str, threads: int, n_ctx: int = 2048, n_batch: int = 512, model: object = None
    ) -> None:
        """Load ``path``, or take ``model`` (another engine's, loaded from ``path``: a context of its own on
        the same weights)."""
        self.model = model or lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_past = 0
        self.forwards = 0

    def reset(self) -> None:
        self.cut(0)
        self.forwards = 0

    def cut(self, n_past: int) -> None:
        """Forget every cached position from ``n_past`` on."""
        lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), 0, n_past, -1)
        self.n_past = n_past

    def argmax(self, tokens: list[int], every: bool = False) -> list[int]:
        """Feed ``tokens`` after the cache; the argmax next token after the last one (``every``: after
        each one)."""
        out: list[int] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            last_chunk = start + self.n_batch >= len(tokens)
            b = self.batch
            b.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                b.token[i] = token
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = every or (last_chunk and i == len(chunk) - 1)
            if lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            self.forwards += 1
            self.n_past += len(chunk)
            rows = range(len(chunk)) if every else ([len(chunk) - 1] if last_chunk else [])
            for i in rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
                out.append(int(np.argmax(logits)))
        return out


def plain(target: Engine, prompt: list[int], n: int, eos: set[int]) -> dict:
    target.reset()
    started = time.perf_counter()
    tokens = target.argmax(prompt)
    while len(tokens) < n and tokens[-1] not in eos:
        tokens += target.argmax(tokens[-1:])
    wall = time.perf_counter() - started
    return {"tokens": tokens, "new_tokens": len(tokens), "wall_s": wall, "target_forwards": target.forwards}


def speculative(target: Engine, draft: Engine, prompt: list[int], n: int, k: int, eos: set[int]) -> dict:
    target.reset()
    draft.reset()
    started = time.perf_counter()
    tokens = target.argmax(prompt)
    draft.argmax(prompt)
    pending = tokens[-1:]  # fed to the draft before its next proposal
    accepted = drafted = 0
    while len(tokens) < n and tokens[-1] not in eos:
        want = min(k, n - len(tokens))
        proposal = draft.argmax(pending)
        while len(proposal) < want:
            proposal += draft.argmax(proposal[-1:])
        base = target.n_past
        checks = target.argmax([tokens[-1], *proposal], every=True)  # checks[i]: after proposal[:i]
        kept = 0
        while kept < len(proposal) and proposal[kept] == checks[kept]:
            kept += 1
        new = [*proposal[:kept], checks[kept]]
        target.cut(base + 1 + kept)
        # The draft holds pending + proposal[:-1]; keep what was accepted, feed the rest next time.
        draft_keep = draft.n_past - (len(proposal) - 1) + min(kept, len(proposal) - 1)
        draft.cut(draft_keep)
        pending = [*proposal[min(kept, len(proposal) - 1) : kept], checks[kept]]
        drafted += len(proposal)
        accepted += kept
        for token in new:
            tokens.append(token)
            if token in eos or len(tokens) >= n:
                break
    wall = time.perf_counter() - started
    return {
        "tokens": tokens,
        "new_tokens": len(tokens),
        "wall_s": wall,
        "target_forwards": target.forwards,
        "drafted": drafted,
        "accepted": accepted,
    }


def peak_gib() -> float:
    with open("/proc/self/status") as status:
        hwm = next(line for line in status if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 2**20


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    lc.llama_backend_init()
    threads, n, eos = spec["threads"], spec["max_new_tokens"], set(spec["eos"])
    target = Engine(spec["target"], threads)
    loaded_plain = peak_gib()
    draft = Engine(spec["draft"], threads)
    runs = []
    for i, prompt in enumerate(spec["prompts"]):
        runs.append({"prompt": i, "mode": "plain", **plain(target, prompt, n, eos)})
        runs.append(
            {"prompt": i, "mode": "speculative", **speculative(target, draft, prompt, n, spec["k"], eos)}
        )
    build = {"llama_cpp_python": lc.__version__, "system_info": lc.llama_print_system_info().decode()}
    print(
        json.dumps(
            {
                "runs": runs,
                "peak_gib_target_only_loaded": loaded_plain,
                "peak_gib": peak_gib(),
                "build": build,
            }
        )
    )


if __name__ == "__main__":
    main()
