"""The vLLM plugin's settings and its batched rule, without vLLM: the batched rewrite must make a
strict greedy verifier accept exactly what marspec's own verify_greedy accepts, block by block."""

from __future__ import annotations

import pytest
import torch

from marspec.integrations.vllm import (
    AcceptCounters,
    VllmPluginConfigError,
    accepted_drafts,
    parse_plugin_config,
    relax_close_calls,
)
from marspec.verify import Rule, verify_greedy


def strict_greedy_batch(logits: torch.Tensor, drafts: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """vLLM's greedy rejection sampler in plain torch: accept while draft == argmax, then the argmax.

    Rows hold K+1 logits per request here (the bonus row included) to compare with verify_greedy.
    """
    out = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.long)
    row = tok = 0
    for b, k in enumerate(counts):
        argmax = logits[row : row + k + 1].argmax(-1)
        n = 0
        while n < k and drafts[tok + n] == argmax[n]:
            out[b, n] = drafts[tok + n]
            n += 1
        out[b, n] = argmax[n]
        row += k + 1
        tok += k
    return out


def near_tie_batch(counts: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [sum(K)+B, V] with many close calls, and drafts picking top-1, top-2 or a third token."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts) + len(counts)
    logits = torch.rand(rows, vocab, generator=g) * 10
    top = torch.randint(vocab, (rows, 2), generator=g)
    logits[torch.arange(rows), top[:, 0]] = 20.0
    second = torch.where(torch.rand(rows, generator=g) < 0.5, 19.5, 15.0)  # ratio 0.975 or 0.75
    logits[torch.arange(rows), top[:, 1]] = torch.where(top[:, 1] == top[:, 0], 20.0, second)
    drafts = []
    row = 0
    for k in counts:
        for i in range(k):
            choice = torch.rand((), generator=g)
            ranked = logits[row + i].argsort(descending=True)
            drafts.append(int(ranked[0] if choice < 0.6 else ranked[1] if choice < 0.9 else ranked[2]))
        row += k + 1
    return logits, torch.tensor(drafts, dtype=torch.int32)


RULES = [
    Rule("mars", 0.9, "logit_ratio"),
    Rule("mars", 1.0, "logit_ratio"),
    Rule("typical", 0.09),
    Rule("pthresh", 0.2),
    Rule("topk", 3),
    Rule("topk", 1),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{r.theta:g}")
@pytest.mark.parametrize("seed", range(5))
def test_batched_rewrite_matches_verify_greedy_on_ragged_blocks(rule: Rule, seed: int) -> None:
    counts = [3, 0, 5, 1, 4]
    logits, drafts = near_tie_batch(counts, vocab=50, seed=seed)
    is_bonus = torch.zeros(logits.shape[0], dtype=torch.bool)
    is_bonus[torch.tensor(counts).add(1).cumsum(0) - 1] = True
    batch = relax_close_calls(logits[~is_bonus], drafts, rule)
    rewritten = logits.clone()
    rewritten[~is_bonus] = batch.logits
    out = strict_greedy_batch(rewritten, drafts.long(), counts)

    row = tok = 0
    for b, k in enumerate(counts):
        ours = verify_greedy(logits[row : row + k + 1], drafts[tok : tok + k].long(), rule)
        expected = ours.emitted()
        assert out[b, : len(expected)].tolist() == expected
        assert (out[b, len(expected) :] == -1).all()
        row += k + 1
        tok += k

    counters = AcceptCounters()
    counters.record(batch, out, torch.tensor(counts), None)
    snap = counters.snapshot()
    assert snap["drafted"] == sum(counts) and snap["steps"] == 4
    relaxed = sum(
        verify_greedy(
            logits[sum(counts[:b]) + b : sum(counts[: b + 1]) + b + 1],
            drafts[sum(counts[:b]) : sum(counts[: b + 1])].long(),
            rule,
        ).n_relaxed
        for b in range(len(counts))
    )
    assert snap["accepted_relaxed"] == relaxed
    if not rule.relaxes:
        assert batch.logits is logits[~is_bonus] or torch.equal(batch.logits, logits[~is_bonus])
        assert relaxed == 0


@pytest.mark.parametrize("rule", [r for r in RULES if r.relaxes], ids=lambda r: f"{r.name}-{r.theta:g}")
def test_every_relaxing_rule_forces_runner_up_rows(rule: Rule) -> None:
    forced = 0
    for seed in range(5):
        logits, drafts = near_tie_batch([3, 0, 5, 1, 4], vocab=50, seed=seed)
        batch = relax_close_calls(logits[: drafts.shape[0]], drafts, rule)
        forced += int((batch.relaxed & ~batch.exact).sum())
    assert forced > 0


def test_accepted_drafts_reads_vllm_output_layout() -> None:
    output = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4]])
    mask = accepted_drafts(output, torch.tensor([3, 0, 3]))
    assert mask.tolist() == [True, False, False, True, True, True]


def test_config_parsing_accepts_defaults_and_refuses_bad_values() -> None:
    assert parse_plugin_config({}) is None
    assert parse_plugin_config(None) is None
    config = parse_plugin_config({"marspec": {}})
    assert config is not None and config.rule == Rule()  # the project's default MARS setting
    strict = parse_plugin_config({"marspec": {"rule": "strict", "log_every": 0}})
    assert strict is not None and not strict.rule.relaxes and strict.log_every == 0
    # A margin named alone takes its own usual threshold, not the default margin's.
    paper = parse_plugin_config({"marspec": {"margin": "logit_ratio"}})
    assert paper is not None and paper.rule == Rule("mars", 0.9, "logit_ratio")
    bad = [
        ({"marspec": {"margin": ["logit_ratio"]}}, "margin"),
        ({"marspec": "mars"}, "JSON object"),
        ({"marspec": {"rule": "loose"}}, "rule"),
        ({"marspec": {"theta": 1.5}}, "theta"),
        ({"marspec": {"theta": "high"}}, "theta"),
        ({"marspec": {"margin": "kl"}}, "margin"),
        ({"marspec": {"tehta": 0.9}}, "tehta"),
        ({"marspec": {"log_every": -1}}, "log_every"),
    ]
    for settings, named in bad:
        with pytest.raises(VllmPluginConfigError, match=named):
            parse_plugin_config(settings)
