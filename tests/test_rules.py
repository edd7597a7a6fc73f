"""marspec.rules and marspec.settings: the rule's names and Rule, the one place settings are checked
(issue 36), and settle, the one place they are filled (issue 55).

Every layer (library, CLI, server, bench methods, the vLLM plugin's config, calibration files) settles its
Rule through marspec.settings, so a bad setting gets the same one-line message from each of them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marspec.api import GenerationOptions
from marspec.calibration import Choice, save_choice
from marspec.cli import app
from marspec.defaults import DEFAULT_MARGIN, DEFAULT_RULE, SAMPLING_MARGIN, SAMPLING_THETA
from marspec.errors import MarspecError
from marspec.eval.harness import run_task
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
)
from marspec.serve.errors import ApiError
from marspec.serve.schemas import ChatCompletionRequest, parse_request
from marspec.serve.settings import ServerSettings
from marspec.settings import rule_name, settle_rule

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
    assert set(RIVALS) < set(RULES) and set(LOSSLESS_RULES) == {"plain", "strict", "block"}
    assert [n for n in RuleName if n.lossless] == ["plain", "strict", "block"]
    assert [m for m in Margin if m.is_ratio] == ["logit_ratio", "prob_ratio"]
    assert GUARDED_RULES[Guard.NEXT] == ("mars",)
    assert set(GUARDED_RULES[Guard.CLASS]) == {"mars", *RIVALS} - {"ensemble"}
    assert set(GUARDED_RULES[Guard.THINKING]) == {"mars", *RIVALS}


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


def test_settle_rule_resolves_options_as_the_library_documents() -> None:
    assert rule_name(None) == DEFAULT_RULE
    assert settle_rule().name == "strict" and Rule().name == "strict"  # unnamed is strict everywhere
    assert settle_rule("plain").name == "strict"  # plain never has a draft to verify
    assert settle_rule("mars") == Rule("mars", 0.5, DEFAULT_MARGIN)
    assert settle_rule("mars", temperature=1.0) == Rule("mars", SAMPLING_THETA, SAMPLING_MARGIN)
    assert settle_rule("mars", margin="logit_ratio") == Rule("mars", 0.9, "logit_ratio")  # its own threshold
    assert settle_rule("mars", AUTO) == settle_rule("mars")  # "auto" without a pair: checked as unset
    assert settle_rule("fly", window=3) == Rule("fly", 0.3, DEFAULT_MARGIN, window=3)
    with pytest.raises(MarspecError, match="no rule is named") as unnamed:
        settle_rule(theta=0.9)
    assert unnamed.value.field == "rule"
    with pytest.raises(MarspecError, match="give rule 'topk' its parameter as a number"):
        settle_rule("topk", AUTO)
    with pytest.raises(MarspecError, match="rule 'typical' needs theta"):
        settle_rule("typical")


def test_a_rule_checks_and_never_fills_in() -> None:
    # What a Rule is not given it does not invent: settling fills it (marspec.settings), nothing else.
    assert Rule() == Rule("strict", None, None) and Rule().theta is None and not Rule().relaxes
    with pytest.raises(MarspecError, match="rule 'mars' needs a margin"):
        Rule("mars", 0.5)
    with pytest.raises(MarspecError, match=r"theta=None is invalid for margin 'prob_ratio'"):
        Rule("mars", margin="prob_ratio")
    with pytest.raises(MarspecError, match="rule 'fly' needs theta"):
        Rule("fly", window=6)
    with pytest.raises(MarspecError, match="rule 'fly' needs a window"):
        Rule("fly", 0.3)


def test_an_unset_margin_is_checked_as_the_librarys_default_margin() -> None:
    # Issue 36's bug: an unset margin was checked as logit_ratio in one layer while the library decoded
    # with prob_ratio. Resolving it in one place makes every layer check the same margin.
    assert settle_rule("mars", 2.0, "logit_gap").theta == 2.0
    for check in (
        lambda: settle_rule("mars", 2.0),
        lambda: GenerationOptions(rule="mars", theta=2.0),
        lambda: parse_methods("mars@2", 0.5),
    ):
        with pytest.raises(MarspecError, match=f"invalid for margin '{DEFAULT_MARGIN}'"):
            check()


def test_check_tree_refuses_chain_only_rules() -> None:
    Rule("mars", 0.5, "prob_ratio").check_tree()
    with pytest.raises(MarspecError, match="'next' guard works on draft chains"):
        Rule("mars", 0.5, "prob_ratio", guard="next").check_tree()
    with pytest.raises(MarspecError, match="FLy defers along a draft chain"):
        Rule("fly", 0.3, window=6).check_tree()


BAD_SETTINGS = [
    {"rule": "eagle"},
    {"rule": "mars", "margin": "kl"},
    {"rule": "mars", "theta": 1.5},
    {"rule": "mars", "theta": 2.0, "margin": "prob_ratio"},
    {"rule": "mars", "theta": -1.0, "margin": "logit_gap"},
    {"rule": "topk", "theta": 2.5},
    {"rule": "pthresh", "theta": 1.5},
    {"rule": "ensemble", "theta": 0.0},
    {"rule": "ensemble", "theta": 1.5},
]


def _message(check) -> str:
    with pytest.raises(MarspecError) as info:
        check()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("settings", BAD_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_layer_refuses_a_bad_setting_with_the_one_message(settings: dict, tmp_path) -> None:
    expected = _message(lambda: settle_rule(**settings))
    flags = [arg for key, value in settings.items() for arg in (f"--{key}", str(value))]
    cli = CliRunner().invoke(app, ["generate", "hi", *flags], env={"COLUMNS": "400"})
    assert cli.exit_code == 2 and " ".join(cli.output.split()) == f"error: {expected}"  # the CLI
    if settings["rule"] == "mars":  # the bench's run setting (--theta, --margin), before any model loads
        theta, margin = str(settings.get("theta", 0.5)), settings.get("margin")
        run = lambda: run_task(task="gsm8k", method_spec="plain", out=tmp_path, theta=theta, margin=margin)  # noqa: E731
        assert _message(run) == expected
    assert _message(lambda: GenerationOptions(**settings)) == expected  # library, hence the CLI
    plugin = _message(lambda: parse_plugin_config({"marspec": settings}))  # the vLLM plugin
    assert plugin == f'additional_config["marspec"]: {expected}'
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


# The defaults of a rule's settings: filled by marspec.settings and nowhere else.
FILLED_DEFAULTS = {
    "DEFAULT_RULE",
    "DEFAULT_THETA",
    "DEFAULT_MARGIN",
    "SAMPLING_THETA",
    "SAMPLING_MARGIN",
    "MARGIN_THETA",
    "FLY_THETA",
    "FLY_WINDOW",
}
# Modules whose --help shows a default (inside an f-string: displayed, never passed on).
SHOWS_DEFAULTS = {"marspec.cli.options", "marspec.cli.run", "marspec.cli.serve"}


def _default_reads(path: Path) -> list[tuple[int, str, bool]]:
    """(line, name, inside an f-string) for each read of a default's name in ``path``."""
    tree = ast.parse(path.read_text())
    in_fstring = {id(n) for f in ast.walk(tree) if isinstance(f, ast.JoinedStr) for n in ast.walk(f)}
    reads = []
    for node in ast.walk(tree):
        name = (
            node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        )
        if name in FILLED_DEFAULTS:
            reads.append((node.lineno, name, id(node) in in_fstring))
    return reads


def test_no_second_place_fills_a_default() -> None:
    root = Path(SRC)
    misplaced = []
    for path in sorted((root / "marspec").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        if module in ("marspec.defaults", "marspec.settings"):
            continue
        for line, name, shown in _default_reads(path):
            if not (shown and module in SHOWS_DEFAULTS):
                misplaced.append(f"{module}:{line} reads {name}")
    assert not misplaced, "a default filled outside marspec.settings: " + "; ".join(misplaced)


def test_the_default_check_sees_a_second_filler(tmp_path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from marspec import defaults\ntheta = defaults.DEFAULT_THETA\nshown = f'{DEFAULT_K}'\n"
    )
    assert _default_reads(planted) == [(2, "DEFAULT_THETA", False)]


def test_every_entry_point_follows_the_one_default(monkeypatch) -> None:
    # Changing a measured default in marspec.defaults changes what every entry point decodes with.
    from marspec import defaults
    from marspec.settings import settle

    monkeypatch.setattr(defaults, "DEFAULT_THETA", 0.7)
    monkeypatch.setattr(defaults, "FLY_WINDOW", 4)
    expected = Rule("mars", 0.7, DEFAULT_MARGIN)
    assert settle(GenerationOptions(rule="mars")).rule == expected  # library, CLI, server
    plugin = parse_plugin_config({"marspec": {"rule": "mars"}})
    assert plugin is not None and plugin.rule == expected  # the vLLM plugin
    assert settle_rule("fly").window == 4 and parse_methods("fly@0.3", 0.7)[0].window is None
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], marspec={})
    server = ServerSettings(model_name="m", defaults=GenerationOptions(rule="mars"))
    served = parse_request(request, server, context_length=0, has_drafter=True)
    assert settle(served.options).rule == expected


def test_thetas_meaning_is_stated_once_and_the_docs_show_it() -> None:
    from marspec.rules import THETA_MEANINGS, theta_table

    docs = (Path(SRC).parent / "docs" / "rules.md").read_text()
    assert theta_table() in docs
    units = {"ratio", "logits", "probability", "rank", "nats", "weight"}
    assert {m.unit for m in THETA_MEANINGS.values()} == units
    for (name, margin), meaning in THETA_MEANINGS.items():  # the table's "never relaxes" is Rule's
        never = {"theta = 1": 1.0, "theta = 0": 0.0, "theta > ln 3 = 1.0986": 1.1}[meaning.never]
        window = 6 if name == "fly" else None
        assert not Rule(name, never, margin or "prob_ratio", window=window).relaxes
