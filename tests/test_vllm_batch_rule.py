"""The vLLM plugin's settings, its batched rule, V2's batch layout and its version checks, without vLLM:
the forced rows must make a strict greedy verifier accept exactly what marspec's own verify_greedy
accepts, block by block, and leave the logits as they were once verification is over."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch

from marspec.integrations.vllm import (
    AcceptCounters,
    VllmPluginConfigError,
    VllmVersionError,
    accepted_drafts,
    decide,
    forced,
    parse_plugin_config,
    v2_layout,
)
from marspec.integrations.vllm.batch_rule import Decisions, accepted_lengths
from marspec.integrations.vllm.versions import V1_VERIFIER, V2_VERIFIER, check_verifier
from marspec.rules import Rule
from marspec.settings import settle_rule
from marspec.verify.greedy import verify_greedy


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
    # FLy: a close call's top-3 entropy here is ~0.66 nats, a clear one's ~0.04; 2 nats never relaxes.
    Rule("fly", 0.3, window=1),
    Rule("fly", 0.3, window=2),
    Rule("fly", 2.0, window=6),
]


def rule_id(rule: Rule) -> str:
    return f"{rule.name}-{rule.theta:g}" + (f"-w{rule.window}" if rule.window else "")


def decided_batch(
    rule: Rule, counts: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Decisions]:
    """A :func:`near_tie_batch` in V2's layout (per request its draft rows, then its bonus row) and the
    rule's decisions on it: logits ``[T + B, V]``, drafts ``[T]``, each row's draft token ``[T + B]``
    (0 on bonus rows), which rows are bonus rows, and the decisions."""
    logits, drafts = near_tie_batch(counts, vocab=50, seed=seed)
    is_bonus = torch.zeros(logits.shape[0], dtype=torch.bool)
    is_bonus[torch.tensor(counts).add(1).cumsum(0) - 1] = True
    row_drafts = torch.zeros(logits.shape[0], dtype=torch.long)  # [T + B]: each draft row's token
    row_drafts[~is_bonus] = drafts.long()
    # Each request's rows, bonus row included, are FLy's blocks.
    decisions = decide(logits, row_drafts, rule, ~is_bonus, lengths=torch.tensor(counts) + 1)
    return logits, drafts, row_drafts, is_bonus, decisions


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
@pytest.mark.parametrize("seed", range(5))
def test_batched_rewrite_matches_verify_greedy_on_ragged_blocks(rule: Rule, seed: int) -> None:
    counts = [3, 0, 5, 1, 4]
    logits, drafts, row_drafts, is_bonus, decisions = decided_batch(rule, counts, seed)
    rewritten = logits.clone()
    with forced(rewritten, decisions.relaxed, row_drafts):
        out = strict_greedy_batch(rewritten, drafts.long(), counts)
    assert torch.equal(rewritten, logits), "the forced rows were not put back"

    row = tok = 0
    for b, k in enumerate(counts):
        ours = verify_greedy(logits[row : row + k + 1], drafts[tok : tok + k].long(), rule)
        expected = ours.emitted()
        assert out[b, : len(expected)].tolist() == expected
        assert (out[b, len(expected) :] == -1).all()
        row += k + 1
        tok += k

    counters = AcceptCounters()
    draft_rows = Decisions(decisions.relaxed[~is_bonus], decisions.exact[~is_bonus])
    counters.record(draft_rows, accepted_lengths(out), torch.tensor(counts), None, ("mars",))
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
        assert not decisions.relaxed.any() and relaxed == 0


@pytest.mark.parametrize("rule", [r for r in RULES if r.relaxes], ids=rule_id)
def test_every_relaxing_rule_forces_runner_up_rows(rule: Rule) -> None:
    relaxed = 0
    for seed in range(5):
        decisions = decided_batch(rule, [3, 0, 5, 1, 4], seed)[-1]
        relaxed += int((decisions.relaxed & ~decisions.exact).sum())
    assert relaxed > 0


def fly_rows(*rows: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-made draft rows over 8 tokens, each ``(kind, draft)``: ``close`` (top-1 token 0 at 5.0,
    runner-up 1 at 4.5: top-3 entropy ~0.7 nats) or ``sure`` (token 0 at 20.0: entropy ~0)."""
    logits = torch.zeros(len(rows), 8)
    for i, (kind, _) in enumerate(rows):
        logits[i, 0], logits[i, 1] = (5.0, 4.5) if kind == "close" else (20.0, 0.0)
    return logits, torch.tensor([draft for _, draft in rows])


def test_fly_defers_only_inside_a_request_and_only_for_greedy_rows() -> None:
    fly = Rule("fly", 0.3, window=1)
    # One request: a close mismatch (draft 1) followed by a top-1 draft: deferred.
    logits, drafts = fly_rows(("close", 1), ("sure", 0))
    assert decide(logits, drafts, fly).relaxed.tolist() == [True, False]
    # The same rows as two requests of one draft each: the window would read the next request's row.
    two = decide(logits, drafts, fly, lengths=torch.tensor([1, 1]))
    assert two.relaxed.tolist() == [False, False]
    # A sampled request's rows are verified strictly under FLy; a greedy one's beside it are deferred.
    logits, drafts = fly_rows(("close", 1), ("sure", 0), ("close", 1), ("sure", 0))
    greedy = torch.tensor([False, False, True, True])
    mixed = decide(logits, drafts, fly, lengths=torch.tensor([2, 2]), greedy=greedy)
    assert mixed.relaxed.tolist() == [False, False, True, False]
    # A sure mismatch is a genuine rejection; a row that verifies nothing (V2's bonus row or a
    # placeholder) never counts as an accepted window row.
    logits, drafts = fly_rows(("sure", 1), ("sure", 0))
    assert not decide(logits, drafts, fly).relaxed.any()
    logits, drafts = fly_rows(("close", 1), ("sure", 0))
    assert not decide(logits, drafts, fly, rows=torch.tensor([True, False])).relaxed.any()


def test_accepted_drafts_reads_vllm_output_layout() -> None:
    output = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4]])
    mask = accepted_drafts(output, torch.tensor([3, 0, 3]))
    assert mask.tolist() == [True, False, False, True, True, True]


def test_config_parsing_accepts_defaults_and_refuses_bad_values() -> None:
    assert parse_plugin_config({}) is None
    assert parse_plugin_config(None) is None
    config = parse_plugin_config({"marspec": {}})
    assert config is not None and config.rule == settle_rule()  # settled as every entry point: strict
    mars = parse_plugin_config({"marspec": {"rule": "mars"}})
    assert mars is not None and mars.rule == Rule("mars", 0.5, "prob_ratio")  # the greedy default
    strict = parse_plugin_config({"marspec": {"rule": "strict", "log_every": 0}})
    assert strict is not None and not strict.rule.relaxes and strict.log_every == 0
    # A margin named alone takes its own usual threshold, not the default margin's.
    paper = parse_plugin_config({"marspec": {"rule": "mars", "margin": "logit_ratio"}})
    assert paper is not None and paper.rule == Rule("mars", 0.9, "logit_ratio")
    fly = parse_plugin_config({"marspec": {"rule": "fly", "theta": 0.2, "window": 3}})
    assert fly is not None and fly.rule == Rule("fly", 0.2, "prob_ratio", window=3)
    bad = [
        ({"marspec": {"rule": "mars", "margin": ["logit_ratio"]}}, "margin"),
        ({"marspec": "mars"}, "JSON object"),
        ({"marspec": {"rule": "loose"}}, "rule"),
        ({"marspec": {"rule": "mars", "theta": 1.5}}, "theta"),
        ({"marspec": {"rule": "mars", "theta": "high"}}, "theta"),
        ({"marspec": {"rule": "mars", "margin": "kl"}}, "margin"),
        ({"marspec": {"tehta": 0.9}}, "tehta"),
        ({"marspec": {"log_every": -1}}, "log_every"),
        ({"marspec": {"rule": "fly", "window": 0}}, "window"),
        ({"marspec": {"rule": "mars", "window": 3}}, "window"),
    ]
    for settings, named in bad:
        with pytest.raises(VllmPluginConfigError, match=named):
            parse_plugin_config(settings)


def test_forced_rows_are_one_hot_inside_and_restored_after() -> None:
    logits = torch.randn(4, 10)
    original = logits.clone()
    relaxed = torch.tensor([False, True, False, True])
    drafts = torch.tensor([0, 7, 0, 2])
    with forced(logits, relaxed, drafts):
        assert torch.equal(logits[[0, 2]], original[[0, 2]])  # rows not relaxed: untouched
        assert logits[1].argmax() == 7 and logits[3].argmax() == 2
        assert torch.softmax(logits[1], -1)[7] == 1.0 and torch.isinf(logits[3, [0, 1, 3]]).all()
    assert torch.equal(logits, original)


def test_v2_layout_reads_draft_rows_placeholders_and_per_request_temperature() -> None:
    # Three requests in V2's layout: rows [0, 3) hold 2 drafts + bonus, row 3 a bonus alone (no draft),
    # rows [4, 8) 3 drafts + bonus whose second draft is a placeholder (-1). Row r verifies row r+1's
    # input token. Request-state slots (idx_mapping) are 2, 0, 1; slot 0 is greedy.
    draft_sampled = torch.tensor([11, 21, 22, 31, 41, 51, -1, 53])
    cu_num_logits = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    expanded_idx_mapping = torch.tensor([2, 2, 2, 0, 1, 1, 1, 1], dtype=torch.int32)
    temperature = torch.tensor([0.0, 0.7, 1.3])  # [max_num_reqs], by slot
    layout = v2_layout(draft_sampled, cu_num_logits, expanded_idx_mapping, temperature, 0)
    assert layout.rows.tolist() == [True, True, False, False, True, False, False, False]
    assert layout.draft_tokens[layout.rows].tolist() == [21, 22, 51]
    assert layout.num_draft_tokens.tolist() == [2, 0, 1]  # the placeholder ends request 2's drafts
    assert layout.greedy.tolist() == [False, False, False, True, False, False, False, False]


def planted(*names: str) -> Callable[..., None]:
    """A function whose signature has exactly these parameter names (a stand-in vLLM release)."""

    def verifier(*args: object) -> None:
        raise AssertionError("a signature check must not call the verifier")

    verifier.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    return verifier


def test_version_check_knows_the_verifiers_and_refuses_others_in_one_line() -> None:
    v1 = V1_VERIFIER.parameters
    check_verifier(planted(*v1, "synthetic_mode"), V1_VERIFIER, "0.32.0")  # known, plus a later keyword
    check_verifier(planted(*V2_VERIFIER.parameters), V2_VERIFIER, "0.32.0")
    earlier = planted(*v1[:5], "target_probs", *v1[6:])  # earlier vLLM: probabilities, sixth
    with pytest.raises(VllmVersionError, match=r"target_probs.*probabilities") as probs:
        check_verifier(earlier, V1_VERIFIER, "0.9.0")
    with pytest.raises(VllmVersionError, match=r"vLLM 9\.9\.9.*V2 verifier") as other:
        check_verifier(planted(*v1), V2_VERIFIER, "9.9.9")
    for error in (probs.value, other.value):
        assert "\n" not in str(error) and "0.32.0" in str(error)
