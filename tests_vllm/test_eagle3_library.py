"""The same EAGLE-3 head, the same rule: vLLM with the plugin and marspec's library decode the same tokens.

The head is test_eagle3.py's (the published format, a bigram table read off the target's plain decoding,
runner-up drafts placed at close calls; see that module's doc), built the same way for the same target
(the smaller model of the pair). vLLM drafts with it (``method="eagle3"``) and the plugin verifies; the
library loads the same head folder as ``draft=`` and verifies with the same rule, one draft token per
step, greedy, fp32 in both. Checked, prompt by prompt: strict (theta 1) gives the same tokens in both,
and MARS at the relaxing setting gives the same tokens in both, with relaxed accepts in both.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_ram import KV_CACHE_GIB, SMALL_ENGINE_GIB, require_free_ram
from test_eagle3 import MAX_TOKENS, RELAXING, K, bigram_drafts, plain_requests, write_eagle3_head

from marspec.integrations.vllm.compare import DEFAULT_PROMPTS, BatchResult, EngineSpec, run_engine


@pytest.fixture(scope="module")
def both(target_dir: str, draft_dir: str | None, tmp_path_factory: pytest.TempPathFactory):
    """vLLM's and the library's tokens for strict and MARS with one head: {setting: (vllm, library)}."""
    from marspec import Decoder

    require_free_ram(SMALL_ENGINE_GIB)
    target = draft_dir or target_dir
    plain = EngineSpec(target, method="none", kv_cache_gib=KV_CACHE_GIB, eager=True)
    plain_run = run_engine(plain, [plain_requests(logprobs=2)]).batches[0]
    proposals, designed = bigram_drafts(plain_run, RELAXING["theta"])
    assert designed, "no close call on these prompts that a runner-up draft could reach"
    head = tmp_path_factory.mktemp("eagle3-library") / "head"
    write_eagle3_head(target, head, proposals)
    settings = {"strict": {"rule": "mars", "theta": 1.0, "margin": "prob_ratio"}, "relaxing": RELAXING}
    results: dict[str, tuple[BatchResult, list[list[int]], int]] = {}
    decoder = Decoder(target, str(head), dtype="fp32", device="cpu", draft_confidence=0.0, lookup=False)
    for name, rule in settings.items():
        spec = EngineSpec(
            target, str(head), k=K, method="eagle3", kv_cache_gib=KV_CACHE_GIB, eager=True, marspec=rule
        )
        vllm_run = run_engine(spec, [plain_requests()]).batches[0]
        library, relaxed = [], 0
        for prompt in DEFAULT_PROMPTS:
            result = decoder.generate(prompt, k=K, max_new_tokens=MAX_TOKENS, chat=False, **rule)
            library.append(result.token_ids)
            relaxed += result.stats.accepted_relaxed
        results[name] = (vllm_run, library, relaxed)
    return results


def test_strict_gives_the_same_tokens_in_vllm_and_the_library(both) -> None:
    vllm_run, library, relaxed = both["strict"]
    assert library == vllm_run.tokens
    assert relaxed == 0


def test_mars_gives_the_same_tokens_in_vllm_and_the_library(both) -> None:
    vllm_run, library, relaxed = both["relaxing"]
    assert vllm_run.counters is not None and vllm_run.counters["accepted_relaxed"] > 0
    assert relaxed > 0
    assert library == vllm_run.tokens
