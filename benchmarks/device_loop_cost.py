"""What the decode loop itself costs per step on a device, apart from its model forwards.

Builds two random-weight Qwen2 models of the default pair's sizes (no download, no packaged weights),
saves them with a tokenizer to a temporary folder and loads them through marspec's ``Decoder`` on
``--device``, as a user's models are loaded. Then it measures, with timings that are right on a GPU
(a device synchronisation before and after each timed forward, so a GPU's queued kernels are counted
and not only their launch):

- the target's forward cost by scored tokens (1, 2, 4, 8, 13: a verification scores the pending token
  and up to k = 12 drafts) and the draft's (1 and 2 tokens), on a cache of the decode's mean length;
- the per-step wall time of plain, strict and MARS decoding with (a) a draft that is an exact copy of
  the target (every draft accepted: the most tokens per step, the loop's overhead ceiling) and (b) the
  small random draft (almost nothing accepted: the most steps per token);
- the loop's own overhead per step: the step's wall time minus its forwards at the measured costs
  (the verification at its size, each draft forward at one token). This does not read the backends'
  clocks, so it is the same measure for any marspec version; the clocks' own figure is printed beside
  it (``clock``) to show whether they time the device's work or only the launches.

The target is made decisive so that a copy of it accepts (almost) every draft in any dtype: its layers'
writes to the residual stream (attention and MLP output projections) are zero, so its next token depends
on the current token only, through the same arithmetic in a one-token and a many-token forward, and its
LM head is sharpened (logits of standard deviation 16) so near-ties that rounding could flip are rare
and the copy is confident enough that its confidence stop lets it draft its whole k. Every layer still
runs its full computation (zeros cost what other weights cost). The end-of-text tokens' head rows are
zero, so no run ends early. The small draft is plain random init: unconfident, so its confidence stop
ends each draft after one token. Cases marked ``conf0`` repeat a case with the stop off: for the copy
they draft the same tokens as with it, so the difference between ``strict/copy`` and
``strict/copy/conf0`` is the stop's cost (one host read per drafted token); for the small draft, k
drafts per step, all rejected.

    python benchmarks/device_loop_cost.py --small --device cpu --dtype fp32   # minutes on a CPU

Each case runs on the eager path and on the fixed-shape path (``graphs="on"``: on CUDA its forwards are
captured as CUDA graphs and replayed, :mod:`marspec.backends.fixed`), interleaved; ``--graphs off`` or
``--graphs on`` runs one of them. Per-forward costs are taken on both paths (the target at 1 and k + 1
tokens, the draft at 1 token and a chunk of one-token forwards queued with no read between them, which
against as many synchronised forwards prices a read of the confidence stop), and ``prediction`` gives
the speed-up over plain that the default pair's tau, measured on a CPU (HumanEval, strict,
docs/results.md "Speed"), predicts from each path's costs: a step scores k + 1 tokens after about tau
draft forwards and yields tau tokens, where plain pays a 1-token forward per token. The JSON file is
written after each part, so a run cut short keeps what it measured.
On a lent GPU it runs as the second part of benchmarks/gpu_check.py (the one command, with the
self-test); alone:

    python benchmarks/device_loop_cost.py --device cuda --dtype bf16 --json out.json

An EAGLE-3 head of the shape published for a target of the default's size (random weights, the
published layout, loaded by path through ``Decoder`` beside a target of its own, which then keeps its
hidden states) adds the head's one-token step and a chunk of them to the per-forward costs,
``head_prediction`` (the speed-up over plain with graphs that a head drafting at each of
:data:`HEAD_TAUS` tokens per step predicts: issue 53's goal) and a ``strict/head`` case: a random head's
drafts are rejected, so that case shows the loop's cost per step with a head and checks that strict
with a head gives plain's tokens on the device, not the speed a trained head gives.

``--small`` builds tiny models of the same shape family (and uses a byte-level tokenizer built in memory
unless ``--tokenizer`` is given), to check the script end to end without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from _common import (  # this folder's shared helpers
    device_sync,
    git_commit,
    median_ms,
    script_parser,
    write_json,
)

import marspec
from marspec.api import Decoder, GenerationOptions
from marspec.decode import decode
from marspec.defaults import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_K
from marspec.drafters.eagle3_fixed import FixedHeadCache
from marspec.drafters.eagle3_head import Eagle3Head, HeadCache
from marspec.eagle3_training.head import head_config, save_head, spec_of
from marspec.models.convert import quiet_transformers
from marspec.models.eagle3 import default_layers
from marspec.profile import ForwardCosts
from marspec.stats import GenerationStats


def shape(hidden: int, layers: int, heads: int, intermediate: int, tied: bool) -> dict:
    """A Qwen2 config's sizes; two key/value heads, as in both models of the default pair."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        intermediate_size=intermediate,
        tie_word_embeddings=tied,
    )


# The default pair's shapes (Qwen2.5-Coder 1.5B and 0.5B Instruct); the vocabulary is the models' 151,936.
FULL = {"target": shape(1536, 28, 12, 8960, tied=False), "draft": shape(896, 24, 14, 4864, tied=True)}
FULL_VOCAB = 151936
# Small shapes of the same family (grouped key/value heads, untied target, tied draft) for --small.
SMALL = {"target": shape(64, 2, 4, 128, tied=False), "draft": shape(32, 2, 4, 64, tied=True)}
DRAFT_SIZES = (1, 2)
# One-token forwards queued back to back for the chunk costs: against as many synchronised ones, what a
# read of the confidence stop after every drafted token costs.
CHUNK = 4
# An EAGLE-3 head of the shape published for a target of the default's size (SpecForge's Qwen2.5 heads: the
# target's width, an 8,960-wide MLP, 32,000 draft tokens); --small: a tiny one over the tiny vocabulary.
HEAD = {"intermediate": 8960, "draft_vocab": 32000}
SMALL_HEAD = {"intermediate": 128, "draft_vocab": 64}
# Tokens per step an EAGLE-3 head could give the default target, for the head's prediction: the head
# trained here (tau ~1.1 in its training evaluation, docs/results.md), break-even and published-head range.
HEAD_TAUS = (1.1, 2.0, 3.0, 4.0, 5.0, 6.0)
# The default pair's strict tau on HumanEval, measured on a CPU (docs/results.md, "Speed": 512 tokens,
# k = 12, 30 questions): the prediction's tokens per step, and about its draft forwards per step.
CPU_TAU = 10.75
# PROMPT's length in Qwen2.5's tokenizer: without --tokenizer the prompt is cut to it, so the forward
# costs are taken at the context the runs with that tokenizer had (92 positions at 128 new tokens).
QWEN_PROMPT_TOKENS = 28
# The decisive target's logits: standard deviation 16, so its top choice has most of the probability.
LOGIT_STD = 16.0
PROMPT = (
    "def fibonacci(n):\n    # Return the n-th Fibonacci number, computed iteratively so that large n "
    "neither recurses deeply nor repeats work.\n"
)


def models_report(device: torch.device, dtype: str, small: bool, shapes: dict, vocab: int) -> dict:
    """A report's first entries: where it ran and on which random models."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "device": str(device),
        "device_name": name,
        "dtype": dtype,
        "small": small,
        "shapes": shapes,
        "vocab": vocab,
    }


def load_tokenizer(folder: str | None):
    if folder is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    from marspec.selftest.tiny import tiny_tokenizer

    return tiny_tokenizer()


def build_model(shape: dict, vocab: int, seed: int, decisive: bool, tokenizer, build_on: torch.device):
    """A random Qwen2 causal LM of ``shape``. ``decisive`` zeroes the layers' residual writes and sharpens
    the head (see the module's docstring). End-of-text (special) tokens' head rows are zeroed either way."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    special = sorted({i for i in (*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder) if i < vocab})
    eos = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=vocab,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        **shape,
    )
    torch.manual_seed(seed)
    with torch.device(build_on):
        model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        if decisive:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            # The head reads a normalised state of norm sqrt(hidden); its weights are drawn with std 0.02.
            scale = LOGIT_STD / (config.initializer_range * config.hidden_size**0.5)
            model.lm_head.weight.mul_(scale)
        if special:
            model.lm_head.weight[special] = 0.0
    return model


def save(model, tokenizer, folder: Path, dtype: torch.dtype) -> Path:
    with quiet_transformers():
        model.to(dtype).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def build_head(target_dir: Path, folder: Path, sizes: dict) -> Path:
    """A random EAGLE-3 head for the target in ``target_dir``, saved in the published layout (random
    weights: it drafts nothing the target accepts, so its decodes show a head step's cost, not its tau)."""
    target_config = json.loads((target_dir / "config.json").read_text())
    n = target_config["num_hidden_layers"]
    layers = default_layers(n) if n >= 8 else (0, n // 2, n)  # --small's 2-layer target: its 3 states
    config = head_config(target_config, sizes["draft_vocab"], sizes["intermediate"], layers)
    torch.manual_seed(2)
    head = Eagle3Head(spec_of(config), len(layers), torch.nn.Identity())  # ~0.1 B weights: built on the CPU
    head.t2d[: sizes["draft_vocab"]] = True  # the draft vocabulary is the first ids: d2t stays 0
    save_head(head, config, folder)
    return folder


@torch.inference_mode()
def head_costs(decoder: Decoder, chunk: int, context: int, repeats: int, device: torch.device) -> dict:
    """Median wall ms of the head's one-token step (fc of a feature, the decoder layer over a cache of
    ``context`` positions, the draft logits) and of ``chunk`` steps queued back to back, each fed the
    previous step's token and stream as the drafter feeds them, synchronised only before and after."""
    head = decoder.drafter.draft_model.head
    fixed = isinstance(decoder.drafter.draft_model.cache, FixedHeadCache)
    cache = FixedHeadCache(head, graphs=decoder.captured) if fixed else HeadCache(head)  # the decoder's kind
    width = head.fc.in_features
    dtype = head.fc.weight.dtype
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(head.d2t.shape[0], (context,), generator=gen).to(device)
    cache.step(tokens, head.fc(torch.randn(context, width, generator=gen).to(device, dtype)))
    state = torch.randn(1, width, generator=gen).to(device, dtype)

    first_stream = head.fc(state)

    def steps(count: int) -> float:
        def drafts() -> None:
            token, stream = tokens[:1], first_stream
            for _ in range(count):
                logits, stream = cache.step(token, stream)
                token = logits[-1].argmax().view(1)

        return median_ms(drafts, repeats, warmup=1, device=device, after=lambda: cache.rollback(context))

    return {"step": steps(1), f"chunk_{chunk}": steps(chunk)}


def predict_head(target_ms: dict[int, float], head_ms: float, k: int, taus) -> list[dict]:
    """:func:`predict` for a head at each tau: a step is one verification of k + 1 tokens after about
    tau head steps (the head's steps stop at its confidence stop as the draft model's do)."""
    return [{**predict(target_ms, head_ms, k, tau), "head_step_ms": head_ms} for tau in taus]


def forwards(lm, inputs: list[torch.Tensor]) -> Callable[[], object]:
    """A call that runs ``lm.forward`` on the next of ``inputs`` each time."""
    remaining = iter(inputs)
    return lambda: lm.forward(next(remaining))


@torch.inference_mode()
def forward_costs(lm, sizes, context: int, repeats: int, device: torch.device) -> dict[int, float]:
    """Median wall seconds of one ``lm.forward`` scoring n tokens on a cache of ``context`` positions,
    synchronised before and after (the loop waits for a forward's result, so that is what it pays)."""
    gen = torch.Generator().manual_seed(0)
    lm.reset()
    lm.forward(torch.randint(lm.vocab_size, (context,), generator=gen).to(device), last_only=True)
    out = {}

    def rollback() -> None:
        lm.rollback(context)

    for n in sizes:
        # The first forward at each size warms its kernels up: not timed.
        inputs = [torch.randint(lm.vocab_size, (n,), generator=gen).to(device) for _ in range(repeats + 1)]
        out[n] = median_ms(forwards(lm, inputs), repeats, warmup=1, device=device, after=rollback) / 1000
    lm.reset()
    return out


@torch.inference_mode()
def chunk_cost(lm, chunk: int, context: int, repeats: int, device: torch.device) -> float:
    """Median wall seconds of ``chunk`` one-token forwards queued back to back (each token the argmax of
    the previous forward, on the device), synchronised only before and after: what they cost with no
    read of the confidence stop between them."""
    gen = torch.Generator().manual_seed(1)
    lm.reset()
    lm.forward(torch.randint(lm.vocab_size, (context,), generator=gen).to(device), last_only=True)
    firsts = iter([torch.randint(lm.vocab_size, (1,), generator=gen).to(device) for _ in range(repeats + 1)])

    def queued() -> None:
        token = next(firsts)
        for _ in range(chunk):
            token = lm.forward(token)[-1].argmax().view(1)

    seconds = median_ms(queued, repeats, warmup=1, device=device, after=lambda: lm.rollback(context)) / 1000
    lm.reset()
    return seconds


def predict(target_ms: dict[int, float], draft_ms: float, k: int, tau: float) -> dict:
    """Speed-up over plain that ``tau`` tokens per step predicts from per-forward costs: a step is one
    verification of k + 1 tokens and about ``tau`` one-token draft forwards (the drafts accepted and the
    one rejected, or the confidence stop's last); plain pays one 1-token target forward per token."""
    step_ms = target_ms[k + 1] + tau * draft_ms
    return {
        "tau": tau,
        "step_ms": step_ms,
        "ms_per_token": step_ms / tau,
        "plain_ms_per_token": target_ms[1],
        "speedup_vs_plain": tau * target_ms[1] / step_ms,
    }


def run_once(decoder: Decoder, rule: str, prompt_ids: torch.Tensor, new_tokens: int, k: int):
    """One decode through marspec's loop, as Decoder.generate runs it; the wall time of each step is
    taken when the loop yields it (each step has read its verdict to the host by then, so the device's
    work for it is done). Returns (step seconds, stats, tokens)."""
    opts = GenerationOptions(rule=rule, k=k, max_new_tokens=new_tokens, reuse_prefix=False)
    config = decoder.settle(opts)
    drafter = None if rule == "plain" else decoder.drafter
    stats = GenerationStats()
    step_s, tokens, clock_s = [], [], []
    device_sync(prompt_ids.device)
    start = time.perf_counter()
    for step in decode(decoder.target, drafter, prompt_ids, config, stats):
        now = time.perf_counter()
        step_s.append(now - start)
        clock_s.append(stats.target_forward_s + stats.draft_forward_s)
        start = now
        tokens.extend(step.tokens)
    return step_s, clock_s, stats, tokens


def summarise(runs, costs: ForwardCosts) -> dict:
    """Per-step means over every step but each run's first (which holds both prefills), medians over runs."""
    wall, model, clock, tau = [], [], [], []
    for step_s, clock_s, stats, _ in runs:
        steps = stats.steps[1:]
        if not steps:
            continue
        # Draft forwards per step as the run made them (a catch-up, chunks past a stop), at one token each.
        per_step = stats.draft_forwards / len(stats.steps)
        forwards = [costs.target_s(s.drafted + s.siblings + 1) + per_step * costs.draft_s(1) for s in steps]
        clocked = [b - a for a, b in itertools.pairwise(clock_s)]
        wall.append(statistics.fmean(step_s[1:]))
        model.append(statistics.fmean(forwards))
        clock.append(statistics.fmean(clocked))
        tau.append(sum(s.emitted for s in steps) / len(steps))
    step_ms = 1000 * statistics.median(wall)
    forward_ms = 1000 * statistics.median(model)
    clock_ms = 1000 * statistics.median(clock)
    last = runs[-1][2]
    return {
        "step_ms": step_ms,
        "forwards_ms": forward_ms,
        "overhead_ms": step_ms - forward_ms,
        "clock_forwards_ms": clock_ms,
        "clock_overhead_ms": step_ms - clock_ms,
        "tokens_per_step": statistics.median(tau),
        "ms_per_token": step_ms / statistics.median(tau),
        "steps": len(last.steps),
        "drafted": last.drafted,
        "accepted": last.accepted_exact + last.accepted_relaxed,
        "draft_forwards": last.draft_forwards,
        "runs": len(wall),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, cpu, cuda:N or mps (default cuda)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument(
        "--tokenizer", help="a Qwen2.5 tokenizer folder for the prompt (default: a byte-level one built here)"
    )
    parser.add_argument("--small", action="store_true", help="tiny models, to check the script on a CPU")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per decode (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="decodes per case, interleaved (default 3)")
    parser.add_argument("--cost-repeats", type=int, default=10, help="timed forwards per size (default 10)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help=f"draft length (default {DEFAULT_K})")
    parser.add_argument(
        "--graphs",
        default="both",
        choices=("both", "off", "on"),
        help="the paths to run: eager (off), fixed-shape (on: CUDA graphs on CUDA), or both (default)",
    )
    parser.add_argument("--tau", type=float, default=CPU_TAU, help=f"tau to predict from (default {CPU_TAU})")
    parser.add_argument(
        "--draft-confidence",
        type=float,
        default=DEFAULT_DRAFT_CONFIDENCE,
        help=f"the drafter's confidence stop (default marspec's {DEFAULT_DRAFT_CONFIDENCE})",
    )
    parser.add_argument("--json", type=Path, default=Path("device_loop_cost.json"), help="where to write")
    return parser.parse_args(argv)


# The pair of decoders each case decodes with, by path ("off": eager, "on": fixed shapes): a small random
# draft, an exact copy of the target as draft, and an EAGLE-3 head (a target of its own).
Decoders = dict[str, tuple[Decoder, Decoder, Decoder]]


class Report:
    """The run's JSON, written again after each part, so that a run cut short keeps what finished."""

    def __init__(self, path: Path, fields: dict) -> None:
        self.path, self.fields, self.begun = path, fields, time.perf_counter()

    def write(self, part: str) -> None:
        self.fields["parts_done"] = [*self.fields.get("parts_done", []), part]
        self.fields["total_s"] = time.perf_counter() - self.begun
        write_json(self.path, self.fields)
        print(f"[{self.fields['total_s']:.0f}s] {part} written to {self.path}", file=sys.stderr)


def load_decoders(args: argparse.Namespace, shapes: dict, vocab: int, tokenizer, modes) -> Decoders:
    """Random models of ``shapes`` built on the device (random init of 1.5B weights is seconds there,
    minutes on a CPU), saved in the run's dtype and loaded back by path through Decoder, per path."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = torch.device(args.device)
    decoders: Decoders = {}
    with tempfile.TemporaryDirectory(prefix="marspec-loop-cost-") as tmp:
        target = build_model(shapes["target"], vocab, 0, True, tokenizer, device)
        target_dir = save(target, tokenizer, Path(tmp) / "target", dtype)
        del target
        draft = build_model(shapes["draft"], vocab, 1, False, tokenizer, device)
        draft_dir = save(draft, tokenizer, Path(tmp) / "draft", dtype)
        del draft
        head_dir = build_head(target_dir, Path(tmp) / "head", SMALL_HEAD if args.small else HEAD)
        for mode in modes:
            # No prompt lookup (random text repeats, and lookup would draft instead of the model), no int8
            # draft (the copy must be the target exactly); the draft's confidence stop as given.
            common = dict(
                dtype=args.dtype,
                device=args.device,
                lookup=False,
                draft_quant="none",
                draft_confidence=args.draft_confidence,
                graphs=mode,
            )
            small = Decoder(str(target_dir), str(draft_dir), **common)
            copy = Decoder(small.target, str(target_dir), **common)  # the same target, a copy as draft
            # A target of its own: a head makes its target keep hidden states, which the others must not pay.
            head = Decoder(str(target_dir), str(head_dir), **common)
            decoders[mode] = (small, copy, head)
    return decoders


def measure_forwards(
    args: argparse.Namespace, report: Report, decoders: Decoders, context: int
) -> dict[str, tuple[ForwardCosts, ForwardCosts, ForwardCosts]]:
    """Part 1: what one forward costs on each path, and the speed-ups predicted from it. Returns, per
    path and by decoder (small draft, copy, head), what a draft forward costs ("draft" is a head step)."""
    device = torch.device(args.device)
    fields, chunk = report.fields, CHUNK
    target_sizes = sorted({1, 2, 4, 8, args.k + 1})
    step_costs = {}
    fields["forward_ms"] = {}
    for mode, (small, _, head) in decoders.items():
        draft_lm = small.drafter.draft_model
        cost = ForwardCosts(context)
        cost.target = forward_costs(small.target, target_sizes, context, args.cost_repeats, device)
        cost.draft = forward_costs(draft_lm, DRAFT_SIZES, context, args.cost_repeats, device)
        fields["forward_ms"][mode] = {
            "target": {n: 1000 * t for n, t in cost.target.items()},
            "draft": {n: 1000 * t for n, t in cost.draft.items()},
            f"draft_chunk_{chunk}": 1000 * chunk_cost(draft_lm, chunk, context, args.cost_repeats, device),
            "captures": _captures(small),
            "head": head_costs(head, chunk, context, args.cost_repeats, device),
        }
        head_step = {1: fields["forward_ms"][mode]["head"]["step"] / 1000}
        step_costs[mode] = (
            cost,
            ForwardCosts(context, cost.target, cost.target),
            ForwardCosts(context, cost.target, head_step),
        )
        predictions(args, fields, mode)
        report.write(f"forwards ({mode})")
    return step_costs


def predictions(args: argparse.Namespace, fields: dict, mode: str) -> None:
    """The speed-ups predicted from the forward costs measured so far (``mode`` the path just done)."""
    measured = fields["forward_ms"]
    fields["prediction"] = {
        m: predict(measured[m]["target"], measured[m]["draft"][1], args.k, args.tau) for m in measured
    }
    # The head's speed-up is over plain decoding with graphs where that path ran: the goal's baseline.
    baseline = measured["on" if "on" in measured else mode]["target"]
    fields["head_prediction"] = {
        m: predict_head(
            {1: baseline[1], args.k + 1: measured[m]["target"][args.k + 1]},
            measured[m]["head"]["step"],
            args.k,
            HEAD_TAUS,
        )
        for m in measured
    }


def decode_kinds(args: argparse.Namespace) -> list[tuple[str, int, str, float, int]]:
    """(name, decoder index, rule, the drafter's confidence stop, tokens per decode). A step of the small
    draft yields about one token, so half the tokens give it as many steps as plain's and keep the GPU run
    short; the copy's steps yield up to k + 1 tokens, so it gets the full count."""
    whole, half = args.new_tokens, max(2, args.new_tokens // 2)
    conf = args.draft_confidence
    kinds = [
        ("plain", 0, "plain", conf, whole),
        ("strict/copy", 1, "strict", conf, whole),
        ("mars/copy", 1, "mars", conf, whole),
        ("strict/small", 0, "strict", conf, half),
        ("mars/small", 0, "mars", conf, half),
        ("strict/head", 2, "strict", conf, half),
    ]
    if conf > 0:
        kinds += [
            ("strict/copy/conf0", 1, "strict", 0.0, whole),
            ("strict/small/conf0", 0, "strict", 0.0, half),
        ]
    return kinds


def measure_decodes(
    args: argparse.Namespace,
    report: Report,
    decoders: Decoders,
    step_costs: dict[str, tuple[ForwardCosts, ForwardCosts, ForwardCosts]],
    prompt_ids: torch.Tensor,
) -> None:
    """Part 2: every case decoded ``args.repeats`` times, interleaved, the summary rewritten each round."""
    modes, kinds, fields = tuple(decoders), decode_kinds(args), report.fields
    cases = [
        (f"{name}@{mode}", decoders[mode][which], rule, c, n, mode, which)
        for mode in modes
        for name, which, rule, c, n in kinds
    ]

    def run(case, new_tokens):
        _, decoder, rule, confidence, _, _, _ = case
        if decoder.drafter is not None:
            decoder.drafter.min_confidence = confidence  # the same drafter, its stop set per case
        return run_once(decoder, rule, prompt_ids, new_tokens, args.k)

    for case in cases:  # warm-up: kernels, captures, allocator, caches grown to the decode's length
        run(case, min(16, case[4]))
    fields["cases"] = {}
    runs: dict[str, list] = {case[0]: [] for case in cases}
    for repeat in range(args.repeats):  # interleaved, so drift on a shared machine hits every case alike
        for case in cases:
            runs[case[0]].append(run(case, case[4]))
        for name, _, _, _, _, mode, which in cases:  # after each round: the decodes so far
            result = summarise(runs[name], step_costs[mode][which])
            result["new_tokens"] = runs[name][-1][2].new_tokens
            tokens, plain_tokens = runs[name][-1][3], runs[f"plain@{mode}"][-1][3]
            if name.startswith("strict"):  # plain decoded the whole count: compare its start
                result["same_tokens_as_plain"] = tokens == plain_tokens[: len(tokens)]
            if mode == "on" and "off" in modes:
                result["same_tokens_as_eager"] = tokens == runs[name.replace("@on", "@off")][-1][3]
            fields["cases"][name] = result
        if len(modes) == 2:
            fields["graphs_speedup"] = {
                name: fields["cases"][f"{name}@off"]["ms_per_token"]
                / fields["cases"][f"{name}@on"]["ms_per_token"]
                for name, *_ in kinds
            }
        report.write(f"decodes (round {repeat + 1} of {args.repeats})")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shapes = SMALL if args.small else FULL
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = len(tokenizer) if args.small else FULL_VOCAB
    modes = ("off", "on") if args.graphs == "both" else (args.graphs,)
    report = Report(
        args.json,
        {
            **models_report(torch.device(args.device), args.dtype, args.small, shapes, vocab),
            "k": args.k,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "draft_confidence": args.draft_confidence,
            "graphs": list(modes),
            "versions": {
                "marspec": marspec.__version__,
                "commit": git_commit(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
            },
            "threads": torch.get_num_threads(),
        },
    )
    decoders = load_decoders(args, shapes, vocab, tokenizer, modes)
    report.fields["build_load_s"] = time.perf_counter() - report.begun
    ids = tokenizer(PROMPT)["input_ids"]
    if args.tokenizer is None and not args.small:
        ids = ids[:QWEN_PROMPT_TOKENS]  # the byte-level tokenizer's ids, as many as Qwen's: the same context
    context = len(ids) + args.new_tokens // 2
    report.fields["prompt_tokens"], report.fields["cost_context"] = len(ids), context
    step_costs = measure_forwards(args, report, decoders, context)
    prompt_ids = torch.tensor(ids, dtype=torch.long, device=torch.device(args.device))
    measure_decodes(args, report, decoders, step_costs, prompt_ids)
    for mode in modes:
        report.fields["forward_ms"][mode]["captures"] = _captures(decoders[mode][0])
        report.fields["forward_ms"][mode]["head_captures"] = _captures(decoders[mode][2])
    report.write("done")
    print(render(report.fields))
    return report.fields


def _captures(decoder: Decoder) -> list[dict]:
    """The CUDA graphs a decoder's models captured: each shape and whether its replay equalled eager."""
    draft = getattr(decoder.drafter, "draft_model", None)
    parts = {"target": decoder.target, "draft": draft, "head": getattr(draft, "cache", None)}
    return [
        {"model": name, "key": list(r.key), "passed": r.passed}
        for name, part in parts.items()
        if getattr(part, "graphs", None) is not None
        for r in part.graphs.records
    ]


def render(report: dict) -> str:
    lines = [
        f"{report['device_name'] or report['device']} {report['dtype']}, k={report['k']}, "
        f"{report['new_tokens']} tokens x {report['repeats']}, commit {report['versions']['commit']}",
    ]
    for mode, forward in report["forward_ms"].items():
        target = ", ".join(f"{n}: {ms:.2f}" for n, ms in forward["target"].items())
        draft = ", ".join(f"{n}: {ms:.2f}" for n, ms in forward["draft"].items())
        chunk = next(v for key, v in forward.items() if key.startswith("draft_chunk"))
        predicted = report["prediction"][mode]
        head = forward.get("head", {})
        heads = ", ".join(
            f"tau {p['tau']}: {p['speedup_vs_plain']:.2f}x" for p in report["head_prediction"][mode]
        )
        lines += [
            f"graphs={mode}: EAGLE-3 head step {head.get('step', float('nan')):.2f} ms; "
            f"predicted over plain{'' if mode == 'on' else ' with graphs'}: {heads}",
            f"graphs={mode}: target forward ms by scored tokens: {target}; draft: {draft}; "
            f"draft chunk of {CHUNK}: {chunk:.2f} ms",
            f"graphs={mode}: tau {predicted['tau']} predicts {predicted['speedup_vs_plain']:.2f}x plain",
        ]
    lines += [
        "",
        "| case | ms/step | forwards ms/step | overhead ms/step | clock overhead ms/step | tokens/step "
        "| ms/token | strict == plain | == eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["cases"].items():
        same = r.get("same_tokens_as_plain", "")
        eager = r.get("same_tokens_as_eager", "")
        lines.append(
            f"| {name} | {r['step_ms']:.2f} | {r['forwards_ms']:.2f} | {r['overhead_ms']:.2f} | "
            f"{r['clock_overhead_ms']:.2f} | {r['tokens_per_step']:.2f} | {r['ms_per_token']:.2f} | {same} "
            f"| {eager} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
