"""marspec.rules: the rule's names and Rule, the one place settings are checked (issue 36).

Every layer (library, CLI, server, bench methods, the vLLM plugin's config, calibration files) builds its
Rule here, so a bad setting gets the same one-line message from each of them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from marspec.api import GenerationOptions
from marspec.calibration import Choice, save_choice
from marspec.defaults import DEFAULT_MARGIN, DEFAULT_RULE, SAMPLING_MARGIN, SAMPLING_THETA
from marspec.errors import MarspecError
from marspec.eval.methods import parse_methods
from marspec.integrations.vllm.config import parse_plugin_config
from marspec.rules import (
    AUTO,
    GUARDED_RULES,
    LOSSLESS_RULES,
    RIVALS,
    RULES,
    Guard,
    Margin,
    Rule,
    RuleName,
    rule_name,
)
from marspec.serve.errors import ApiError
from marspec.serve.schemas import ChatCompletionRequest, parse_request
from marspec.serve.settings import ServerSettings

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_names_are_strings_to_every_caller() -> None:
    rule = Rule("mars", 0.9, "logit_ratio", "class")
    assert (rule.name, rule.margin, rule.guard) == (RuleName.MARS, Margin.LOGIT_RATIO, Guard.CLASS)
    # Users and stored files keep the plain strings: equal, hashed alike, formatted and serialised as such.
    assert rule.name == "mars" and {"logit_ratio": 1}[rule.margin] == 1 and f"{rule.guard}" == "class"
    assert json.loads(json.dumps(asdict(rule))) == {
        "name": "mars",
        "theta": 0.9,
        "margin": "logit_ratio",
        "guard": "class",
        "window": None,
    }
    assert repr(rule) == "Rule(name='mars', theta=0.9, margin='logit_ratio', guard='class', window=None)"
    assert Rule(RuleName.MARS, 0.9, Margin.LOGIT_RATIO, Guard.CLASS) == rule


def test_the_name_lists_come_from_the_enums() -> None:
    assert "plain" not in RULES and {*RULES, "plain"} == set(RuleName)  # plain verifies nothing
    assert set(RIVALS) < set(RULES) and set(LOSSLESS_RULES) == {"plain", "strict"}
    assert [n for n in RuleName if n.lossless] == ["plain", "strict"]
    assert [m for m in Margin if m.is_ratio] == ["logit_ratio", "prob_ratio"]
    assert GUARDED_RULES[Guard.NEXT] == ("mars",) and set(GUARDED_RULES[Guard.CLASS]) == {"mars", *RIVALS}


@pytest.mark.parametrize(
    ("kind", "value", "field"),
    [(RuleName, "eagle", "rule"), (Margin, "kl", "margin"), (Guard, "maybe", "guard"), (Margin, 3, "margin")],
)
def test_an_unknown_name_is_one_line_naming_the_choices_and_its_field(kind, value, field) -> None:
    with pytest.raises(MarspecError) as info:
        kind.parse(value, field)
    message = str(info.value)
    assert message == f"unknown {field} {value!r}; use one of: {', '.join(kind)}"
    assert info.value.field == field


def test_rule_of_resolves_options_as_the_library_documents() -> None:
    assert rule_name(None) == DEFAULT_RULE
    assert Rule.of() == Rule("strict")
    assert Rule.of("plain") == Rule("strict")  # plain never has a draft to verify
    assert Rule.of("mars") == Rule("mars", 0.5, DEFAULT_MARGIN)
    assert Rule.of("mars", temperature=1.0) == Rule("mars", SAMPLING_THETA, SAMPLING_MARGIN)
    assert Rule.of("mars", margin="logit_ratio") == Rule("mars", 0.9, "logit_ratio")  # its own threshold
    assert Rule.of("mars", AUTO) == Rule.of("mars")  # "auto" is resolved per pair, later: checked as unset
    assert Rule.of("fly", window=3) == Rule("fly", 0.3, DEFAULT_MARGIN, window=3)
    with pytest.raises(MarspecError, match="no rule is named") as unnamed:
        Rule.of(theta=0.9)
    assert unnamed.value.field == "rule"
    with pytest.raises(MarspecError, match="give rule 'topk' its parameter as a number"):
        Rule.of("topk", AUTO)
    with pytest.raises(MarspecError, match="rule 'typical' needs theta"):
        Rule.of("typical")


def test_an_unset_margin_is_checked_as_the_librarys_default_margin() -> None:
    # Issue 36's bug: an unset margin was checked as logit_ratio in one layer while the library decoded
    # with prob_ratio. Resolving it in one place makes every layer check the same margin.
    assert Rule.of("mars", 2.0, "logit_gap").theta == 2.0
    for check in (
        lambda: Rule.of("mars", 2.0),
        lambda: GenerationOptions(rule="mars", theta=2.0),
        lambda: parse_methods("mars@2", 0.5),
    ):
        with pytest.raises(MarspecError, match=f"invalid for margin '{DEFAULT_MARGIN}'"):
            check()


def test_check_tree_refuses_chain_only_rules() -> None:
    Rule("mars", 0.5).check_tree()
    with pytest.raises(MarspecError, match="'next' guard works on draft chains"):
        Rule("mars", 0.5, guard="next").check_tree()
    with pytest.raises(MarspecError, match="FLy defers along a draft chain"):
        Rule("fly").check_tree()


BAD_SETTINGS = [
    {"rule": "eagle"},
    {"rule": "mars", "margin": "kl"},
    {"rule": "mars", "theta": 1.5},
    {"rule": "mars", "theta": 2.0, "margin": "prob_ratio"},
    {"rule": "mars", "theta": -1.0, "margin": "logit_gap"},
    {"rule": "topk", "theta": 2.5},
    {"rule": "pthresh", "theta": 1.5},
]


def _message(check) -> str:
    with pytest.raises(MarspecError) as info:
        check()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("settings", BAD_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_layer_refuses_a_bad_setting_with_the_one_message(settings: dict) -> None:
    expected = _message(lambda: Rule.of(**settings))
    # The plugin's config is a Rule itself (no options to resolve, and no plain: vLLM always drafts).
    as_rule = {"name" if key == "rule" else key: value for key, value in settings.items()}
    rule_message = _message(lambda: Rule(**as_rule))
    assert rule_message == expected.replace("plain, ", "")
    assert _message(lambda: GenerationOptions(**settings)) == expected  # library, hence the CLI
    plugin = _message(lambda: parse_plugin_config({"marspec": settings}))  # the vLLM plugin
    assert plugin == f'additional_config["marspec"]: {rule_message}'
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], marspec=settings)
    with pytest.raises(ApiError) as bad:  # the server: a 400 naming the request's parameter
        parse_request(request, ServerSettings(model_name="m"), context_length=0, has_drafter=True)
    assert bad.value.status == 400 and bad.value.message.endswith(expected)
    assert bad.value.param in {f"marspec.{key}" for key in settings}
    if settings["rule"] in ("mars", *RIVALS) and "theta" in settings:  # a bench method name
        kind = {"logit_gap": "mars-gap", "prob_ratio": "mars-prob"}.get(
            settings.get("margin"), settings["rule"]
        )
        assert _message(lambda: parse_methods(f"{kind}@{settings['theta']}", 0.5)) == expected


def test_a_calibration_stores_only_a_setting_the_rule_accepts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MARSPEC_CALIBRATION_DIR", str(tmp_path))
    bad = Choice("kl", 0.5, budget=0.98, met_budget=True, reason="", temperature=0.0, tasks={})
    with pytest.raises(MarspecError, match="unknown margin 'kl'"):
        save_choice("t", "d", bad)
    assert not list(tmp_path.iterdir())


def test_the_rules_module_loads_without_torch() -> None:
    # The CLI checks settings before it loads a model; importing the rules must not cost torch's import.
    code = "import sys, marspec.rules; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": SRC}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
