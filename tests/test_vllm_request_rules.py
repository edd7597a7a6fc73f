"""Per-request rules and the metrics files of the vLLM plugin, without vLLM: a request's settings are
validated like the deployment's, each row of a mixed batch is decided by its own request's rule, the
counters are kept per rule, and the workers' counter files add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marspec.integrations.vllm.batch_rule import AcceptCounters, RuleTable, decide, decide_each
from marspec.integrations.vllm.config import VllmPluginConfigError, parse_plugin_config, parse_request_rule
from marspec.integrations.vllm.metrics import CounterFile, read_counter_files
from marspec.rules import Rule


def test_a_request_without_marspec_settings_takes_the_deployments_rule() -> None:
    assert parse_request_rule(None) is None
    assert parse_request_rule({"other_extension": 1}) is None


@pytest.mark.parametrize(
    "settings",
    [{"rule": "mars", "theta": 0.8, "margin": "logit_ratio"}, '{"rule": "pthresh", "theta": 0.3}', {}],
)
def test_a_request_names_its_rule_as_an_object_or_a_json_string(settings: object) -> None:
    rule = parse_request_rule({"marspec": settings})
    as_object = json.loads(settings) if isinstance(settings, str) else settings
    # The same object means the same rule in a request as in additional_config["marspec"].
    deployment = parse_plugin_config({"marspec": as_object})
    assert deployment is not None and rule == deployment.rule


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"theta": 1.5}, "theta"),
        ({"rule": "lenient"}, "lenient"),
        ({"log_every": 5}, "log_every"),  # the deployment's key, not a request's
        ("mars", "not JSON"),
        ([1], "JSON object"),
        ({"rule": "fly", "window": 4}, "window=4.*num_speculative_tokens=4"),
    ],
)
def test_a_bad_request_setting_is_refused_in_one_line(settings: object, named: str) -> None:
    with pytest.raises(VllmPluginConfigError, match=named) as refused:
        parse_request_rule({"marspec": settings}, num_speculative_tokens=4)
    assert "\n" not in str(refused.value) and 'extra_args["marspec"]' in str(refused.value)


def test_the_rule_table_lists_each_distinct_rule_once_with_the_deployments_first() -> None:
    default, strict, loose = Rule("mars", 0.9, "logit_ratio"), Rule("strict"), Rule("mars", 0.5, "prob_ratio")
    assert RuleTable.build(default, [None, None], torch.device("cpu")).of_request is None
    table = RuleTable.build(default, [strict, None, loose, strict], torch.device("cpu"))
    assert table.rules == (default, strict, loose)
    assert table.of_request is not None and table.of_request.tolist() == [1, 0, 2, 1]
    assert table.names == ("mars", "strict")
    name_of_request = table.name_of_request()
    assert name_of_request is not None and name_of_request.tolist() == [1, 0, 0, 1]


def test_each_row_is_decided_by_its_own_requests_rule() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g)
    logits[:, 7] = logits.max(1).values - 0.05  # token 7 is a close runner-up (or top) everywhere
    draft = torch.full((12,), 7)
    rules = (Rule("mars", 0.9, "logit_ratio"), Rule("strict"), Rule("pthresh", 0.01))
    table = RuleTable(rules, torch.tensor([0, 1, 2, 1]))
    lengths = torch.tensor([3, 3, 3, 3])
    row_rule = torch.repeat_interleave(table.of_request, lengths)  # type: ignore[arg-type]
    mixed = decide_each(logits, draft, table, row_rule, lengths=lengths)
    for index, rule in enumerate(rules):
        alone = decide(logits, draft, rule, lengths=lengths)
        rows = row_rule == index
        assert torch.equal(mixed.relaxed[rows], alone.relaxed[rows]), rule
        assert torch.equal(mixed.exact, alone.exact)
    assert mixed.relaxed[row_rule == 0].any() and not mixed.relaxed[row_rule == 1].any()


def test_counters_are_kept_per_rule_and_add_up() -> None:
    decisions = decide(torch.eye(6)[[0, 1, 2, 3, 4, 5]] * 5, torch.tensor([0, 1, 0, 3, 4, 0]), Rule("strict"))
    counters = AcceptCounters()
    counters.record(
        decisions,
        n_accepted=torch.tensor([2, 0, 2]),  # request 0 accepts both drafts, request 1 none, request 2 both
        num_draft_tokens=torch.tensor([2, 1, 3]),
        greedy_rows=None,
        names=("mars", "strict"),
        name_of_request=torch.tensor([0, 1, 0]),
    )
    by_rule = counters.by_rule()
    assert by_rule["mars"] == {
        "steps": 2,
        "drafted": 5,
        "accepted_exact": 4,
        "accepted_relaxed": 0,
        "rejected": 1,
    }
    assert by_rule["strict"] == {
        "steps": 1,
        "drafted": 1,
        "accepted_exact": 0,
        "accepted_relaxed": 0,
        "rejected": 1,
    }
    total = counters.snapshot()
    assert total["drafted"] == 6 and total["accepted_exact"] == 4 and total["steps"] == 3


def test_the_workers_counter_files_are_summed_per_rule(tmp_path: Path) -> None:
    first = CounterFile(tmp_path)
    first.write(
        {"mars": {"steps": 3, "drafted": 10, "accepted_exact": 4, "accepted_relaxed": 2, "rejected": 1}}
    )
    first.write(
        {"mars": {"steps": 4, "drafted": 12, "accepted_exact": 5, "accepted_relaxed": 2, "rejected": 2}}
    )
    second = CounterFile(tmp_path)
    second.path = tmp_path / "counters-other.json"  # another worker's file (another process's pid)
    second.write(
        {"mars": {"steps": 1, "drafted": 4, "accepted_exact": 1, "accepted_relaxed": 1, "rejected": 1}}
    )
    second.write(
        {"strict": {"steps": 2, "drafted": 8, "accepted_exact": 3, "accepted_relaxed": 0, "rejected": 2}}
    )
    (tmp_path / "counters-broken.json").write_text('{"mars": {"steps"')  # torn: skipped, not summed
    totals = read_counter_files(tmp_path)
    assert totals == {
        "mars": {"steps": 4, "drafted": 12, "accepted_exact": 5, "accepted_relaxed": 2, "rejected": 2},
        "strict": {"steps": 2, "drafted": 8, "accepted_exact": 3, "accepted_relaxed": 0, "rejected": 2},
    }
    assert not list(tmp_path.glob("*.tmp")), "a staging file was left behind"
