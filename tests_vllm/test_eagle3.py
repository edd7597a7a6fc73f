"""MARS with a target-coupled drafter, the paper's setting: vLLM drafts with an EAGLE-3 head for the Qwen
target, and the plugin verifies.

No trained EAGLE-3 head for Qwen2.5-Coder is reachable here, so the test constructs one in the format
vLLM loads (``LlamaForCausalLMEagle3``, as EAGLE-3 checkpoints are published: ``midlayer.*``, ``fc``,
``norm``, ``lm_head`` over a reduced draft vocabulary, ``d2t``/``t2d`` maps). Like a real head it drafts
over a small vocabulary, here the few tokens the target itself emits on the test prompts (a real head's
are the corpus's most frequent tokens). Its decoder layer's attention and MLP weights are random; its
output path is taken from the target (``fc`` passes on the output of the target's last layer, ``norm``
is the target's, ``lm_head`` the target's rows of the draft vocabulary), so at position t it ranks the
draft vocabulary as the target ranks it at t: first, the token the target has just emitted. What turns
that into a proposal for t+2 is the ``d2t`` map (draft id -> target id), which the test writes as a
bigram table read off the target's own plain decoding of the prompts: after a token ``a`` the head
proposes the token the target emitted after ``a`` there, or, for one ``a`` per prompt where it can,
the target's *runner-up* at a close call after ``a`` (see :func:`bigram_drafts`). So this head is
built to draft both what the target takes and what it ranks second at a close call: it is no drafter
of any quality (it knows only these prompts), and it says nothing about how often MARS relaxes a
trained head's drafts; it exercises vLLM's EAGLE-3 path and the plugin's verifying (and relaxing) of
its drafts on the real target.

Three engines on one greedy batch (the default prompts, 32 tokens, one draft token per step, so that
which position a draft verifies follows from the accepts before it, and the head's runner-up drafts can
be placed where they are reached; with two, vLLM's second proposal would come from the head's own
state): plain decoding (no speculation; it also reports the target's top-2 at every position,
logprobs=2, from which the head is built), vLLM's EAGLE-3 as shipped (plugin not loaded), and the plugin
deployed at theta 1.0, which runs the batch twice: with the deployment's rule, then with each request
asking for MARS at a relaxing setting (prob_ratio 0.3: the runner-up has at least 0.3 of the top token's
probability; counters are read per batch). Checked: shipped == plain and theta 1 == shipped token for
token, with drafts accepted; MARS relaxes at least once; each request's output equals strict's up to its
first difference, where it holds the target's runner-up at a close call of the strict run (read from the
plain run's logprobs), as only a relaxed accept can make it; counters add up. And marspec's library,
given the same head and prompts, decodes each rule's tokens as its engine does.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from eagle3_heads import write_head
from engine_ram import KV_CACHE_GIB, SMALL_ENGINE_GIB, require_free_ram

from marspec.integrations.vllm.compare import DEFAULT_PROMPTS, BatchResult, EngineSpec, Request, run_engine

MAX_TOKENS = 32
K = 1  # draft tokens per step (see the module doc)
INTERMEDIATE = 256  # the head's MLP width (random, so kept small)
# MARS relaxing where the runner-up has at least 0.3 of the top token's probability (marspec's default is
# 0.5: these four prompts have fewer close calls above it that a runner-up draft can reach).
RELAXING = {"rule": "mars", "theta": 0.3, "margin": "prob_ratio"}
# The plugin's rules: the first is the deployment's, the second each request's own in a second batch.
RULES = {"theta=1.0": {"rule": "mars", "theta": 1.0, "margin": "prob_ratio"}, "relaxing": RELAXING}
# The head proposes a runner-up only where the plain run's p2/p1 clears the threshold by this much, so
# that the verification's logits (another batch shape, another rounding) make the same close call.
DESIGN_MARGIN = 0.1
# Where the target's own p2/p1 at the previous position is below this, the head's proposal is sure.
CLEAR = 0.3
# The relaxed token's p2/p1, read from the plain run, may sit this little below the threshold for the
# same reason (a close call the verifier saw just above it).
RATIO_TOLERANCE = 0.02


def plain_requests(logprobs: int | None = None, rule: dict[str, object] | None = None) -> list[Request]:
    return [Request(p, max_tokens=MAX_TOKENS, logprobs=logprobs, marspec=rule) for p in DEFAULT_PROMPTS]


def top2(plain: BatchResult, request: int, position: int) -> tuple[int, int, float]:
    """The target's top-1 and runner-up at ``position`` of ``request`` in the plain run, and p2/p1."""
    assert plain.top is not None
    (first, logp1), (second, logp2) = plain.top[request][position][:2]
    return int(first), int(second), math.exp(logp2 - logp1)


def first_relaxed(
    plain: BatchResult, request: int, proposals: dict[int, int], threshold: float
) -> int | None:
    """Where MARS at ``threshold`` would first relax ``request`` with a head drafting ``proposals``, one
    draft per step, if the target decides as in ``plain``: the step after a rejected draft verifies the
    next position, the step after an accepted one the position after its bonus token."""
    tokens = plain.tokens[request]
    position = 1  # the prefill emits position 0; the first draft is for position 1
    while position < len(tokens):
        draft = proposals.get(tokens[position - 1])
        _, second, ratio = top2(plain, request, position)
        if draft == tokens[position]:
            position += 2
            continue
        if draft == second and ratio > threshold:
            return position
        position += 1
    return None


def bigram_drafts(plain: BatchResult, threshold: float) -> tuple[dict[int, int], dict[int, int]]:
    """The head's proposal after each token the target emitted in ``plain`` (one proposal per token,
    each proposed token for one token only: ``d2t`` must be one-to-one), and, per request, the
    position where MARS at ``threshold`` should first relax.

    First, after each token, what the target emitted after its first occurrence. Then, request by
    request, the first close call (p2/p1 > ``threshold`` + DESIGN_MARGIN) that a draft reaches (see
    :func:`first_relaxed`) and where the target was sure of the previous token (p2/p1 < CLEAR there,
    so that the head, whose ranking is the target's there plus its random layer's noise, surely
    proposes what follows that token) becomes the runner-up's: the previous token's proposal is
    changed to the runner-up (swapped with the token that proposed it, if any), if that keeps every
    request designed before at its position.
    """
    proposals: dict[int, int] = {}
    for tokens in plain.tokens:
        for previous, token in itertools.pairwise(tokens):
            if previous not in proposals and token not in proposals.values():
                proposals[previous] = token
    designed: dict[int, int] = {}
    for request, tokens in enumerate(plain.tokens):
        for position in range(1, len(tokens)):
            _, second, ratio = top2(plain, request, position)
            previous_ratio = top2(plain, request, position - 1)[2]
            if ratio <= threshold + DESIGN_MARGIN or previous_ratio >= CLEAR:
                continue
            previous = tokens[position - 1]
            trial = {**proposals, previous: second}
            # One-to-one: a token that proposed the runner-up takes the previous token's old proposal.
            for other, proposal in proposals.items():
                if proposal == second and other != previous:
                    del trial[other]
                    if previous in proposals:
                        trial[other] = proposals[previous]
            wanted = {**designed, request: position}
            if all(first_relaxed(plain, r, trial, threshold) == j for r, j in wanted.items()):
                proposals, designed = trial, wanted
                break
    return proposals, designed


def write_eagle3_head(target_dir: str, head_dir: Path, proposals: dict[int, int], seed: int = 0) -> None:
    """An EAGLE-3 head for ``target_dir`` in the published checkpoint format (see the module doc) that,
    after the target emits token ``a``, drafts ``proposals[a]``: the library tests' builder
    (tests/eagle3_heads.py), with the MLP width and the rope parameters vLLM's config reader wants."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    layers = target["num_hidden_layers"]
    rope_theta = target.get("rope_theta") or target.get("rope_parameters", {}).get("rope_theta", 10000.0)
    write_head(
        head_dir,
        target,
        Path(target_dir),
        proposals,
        seed=seed,
        # The target layers whose output the head reads (vLLM's default for Qwen2 is (2, L/2, L-3));
        # L, the last layer's output, makes fc's pass-through the target's own final hidden state.
        layers=[2, layers // 2, layers],
        config_changes={"rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"}},
        intermediate=INTERMEDIATE,
    )


@pytest.fixture(scope="module")
def eagle_target_dir(target_dir: str, draft_dir: str | None) -> str:
    """The smaller model of the pair (the 0.5B draft of the default pair) as EAGLE-3's target: the test
    needs no draft model, and three engines on the 1.5B take minutes more."""
    return draft_dir or target_dir


@pytest.fixture(scope="module")
def eagle_free_ram() -> None:
    """Enough RAM free for one engine on the 0.5B model with its KV cache, checked once."""
    require_free_ram(SMALL_ENGINE_GIB)


@pytest.fixture(scope="module")
def head(
    eagle_target_dir: str, eagle_free_ram: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[BatchResult, Path]:
    """The plain run (with the target's top-2 at every position) and the head built from it."""
    plain = EngineSpec(eagle_target_dir, method="none", kv_cache_gib=KV_CACHE_GIB, eager=True)
    plain_run = run_engine(plain, [plain_requests(logprobs=2)]).batches[0]
    folder = tmp_path_factory.mktemp("eagle3") / "head"
    proposals, designed = bigram_drafts(plain_run, RELAXING["theta"])
    assert designed, "no close call on these prompts that a runner-up draft could reach: change the prompts"
    print(
        f"EAGLE-3 head: {len(proposals)} draft tokens; runner-up drafts reach (request: position) {designed}"
    )
    write_eagle3_head(eagle_target_dir, folder, proposals)
    return plain_run, folder


@pytest.fixture(scope="module")
def runs(eagle_target_dir: str, head: tuple[BatchResult, Path]) -> dict[str, BatchResult]:
    plain_run, folder = head

    def spec(**kwargs: object) -> EngineSpec:
        return EngineSpec(
            eagle_target_dir,
            str(folder),
            k=K,
            method="eagle3",
            kv_cache_gib=KV_CACHE_GIB,
            eager=True,
            **kwargs,
        )  # type: ignore[arg-type]

    shipped = run_engine(spec(load_plugin=False), [plain_requests()]).batches[0]
    deployed, asked = run_engine(
        spec(marspec=RULES["theta=1.0"]), [plain_requests(), plain_requests(rule=RULES["relaxing"])]
    ).batches
    return {"plain": plain_run, "shipped": shipped, "theta=1.0": deployed, "relaxing": asked}


@pytest.fixture(scope="module")
def library(eagle_target_dir: str, head: tuple[BatchResult, Path]) -> dict[str, tuple[list[list[int]], int]]:
    """The library's tokens for each rule's engine, with the same head and prompts: {rule: (tokens of each
    request, relaxed accepts)}."""
    from marspec import Decoder

    decoder = Decoder(
        eagle_target_dir, str(head[1]), dtype="fp32", device="cpu", draft_confidence=0.0, lookup=False
    )
    results = {}
    for name, rule in RULES.items():
        tokens, relaxed = [], 0
        for prompt in DEFAULT_PROMPTS:
            result = decoder.generate(prompt, k=K, max_new_tokens=MAX_TOKENS, chat=False, **rule)
            tokens.append(result.token_ids)
            relaxed += result.stats.accepted_relaxed
        results[name] = (tokens, relaxed)
    return results


def test_vllm_eagle3_strict_equals_plain_decoding(runs: dict[str, BatchResult]) -> None:
    assert runs["shipped"].tokens == runs["plain"].tokens
    assert all(len(tokens) == MAX_TOKENS for tokens in runs["plain"].tokens)


def test_mars_theta_one_equals_strict_with_eagle3(runs: dict[str, BatchResult]) -> None:
    strict = runs["theta=1.0"]
    assert strict.tokens == runs["shipped"].tokens
    assert strict.counters is not None and strict.counters["accepted_relaxed"] == 0
    assert strict.counters["accepted_exact"] > 0, (
        "the head's drafts were never accepted: nothing was compared"
    )


def test_mars_relaxes_eagle3_drafts_only_at_close_calls(runs: dict[str, BatchResult]) -> None:
    """Before a request's first relaxed accept, MARS decodes exactly what strict decodes, so where the
    two first differ the target's logits are the strict run's: MARS's token there must be that run's
    runner-up, at a close call."""
    relaxing, plain = runs["relaxing"], runs["plain"]
    assert relaxing.counters is not None
    assert relaxing.counters["accepted_relaxed"] > 0, "MARS relaxed no EAGLE-3 draft"
    differing = 0
    for request, (ours, strict) in enumerate(zip(relaxing.tokens, plain.tokens, strict=True)):
        first = next((i for i, (a, b) in enumerate(zip(ours, strict, strict=False)) if a != b), None)
        if first is None:
            assert len(ours) == len(strict)
            continue
        differing += 1
        top1, second, ratio = top2(plain, request, first)
        assert (strict[first], ours[first]) == (top1, second), f"request {request}, position {first}"
        assert ratio > RELAXING["theta"] - RATIO_TOLERANCE, f"request {request}: p2/p1 = {ratio:.3f}"
    # Each request that differs was relaxed at least once.
    assert differing <= relaxing.counters["accepted_relaxed"]
    # For the record (pytest -rP shows it): what the engines did.
    for name in ("theta=1.0", "relaxing"):
        print(f"EAGLE-3 {name}: {runs[name].counters}")
    print(f"EAGLE-3 relaxing: {differing} of {len(plain.tokens)} requests differ from strict")


def test_mars_counters_add_up_with_eagle3(runs: dict[str, BatchResult]) -> None:
    for name in ("theta=1.0", "relaxing"):
        c = runs[name].counters
        assert c is not None and c["drafted"] > 0
        accepted = c["accepted_exact"] + c["accepted_relaxed"]
        # One draft token per step: each step accepts it or ends in a rejection.
        assert c["drafted"] == c["steps"] * K
        assert accepted + c["rejected"] == c["drafted"]
        assert c["mean_accepted"] == pytest.approx(accepted / c["steps"])
        # Each request's output is one token per verification step plus its accepted drafts (plus the
        # prefill's first token), so the accepted drafts can never reach the tokens generated.
        assert accepted < runs[name].new_tokens


def test_the_library_gives_vllms_tokens_with_the_same_head_and_rule(runs, library) -> None:
    """marspec's own Decoder with the head (folder) on the same target gives each engine's tokens:
    strict's (MARS at theta 1, nothing relaxed) and the relaxing rule's (relaxed in both)."""
    tokens, relaxed = library["theta=1.0"]
    assert tokens == runs["theta=1.0"].tokens and relaxed == 0
    tokens, relaxed = library["relaxing"]
    assert runs["relaxing"].counters is not None and runs["relaxing"].counters["accepted_relaxed"] > 0
    assert relaxed > 0
    assert tokens == runs["relaxing"].tokens
