"""The rule families (marspec.families) are where rules are told apart: each states its own facts, and no
module outside them branches on a rule's name.

The scan reads every module of src/marspec but the families' own: a comparison of anything with a rule's
name (``== "mars"``, ``is RuleName.FLY``, ``in ("typical", ...)``, a ``case "topk":``) is a decision
that belongs in the rule's family, asked through ``Rule.family`` (or, by name, ``rule_family``). A name
looked up in a collection (``"strict" in summary["methods"]``) is not a branch on a rule and is not
flagged; a table built from the families (``in RIVALS``) is how the others ask.
"""

from __future__ import annotations

import ast
from pathlib import Path

from marspec.families import FAMILIES
from marspec.families.guards import GUARDS
from marspec.rules import RULES, THETA_MEANINGS, Rule, RuleName, rule_family

SRC = Path(__file__).resolve().parents[1] / "src" / "marspec"
NAMES = frozenset(str(name) for name in RuleName)


def _is_rule_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in NAMES
    owner = node.value if isinstance(node, ast.Attribute) else None
    return isinstance(owner, ast.Name) and owner.id == "RuleName"


def name_branches(source: str) -> list[int]:
    """The lines of ``source`` that compare something with a rule's name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides[:-1], sides[1:], strict=True):
                if isinstance(op, ast.Eq | ast.NotEq | ast.Is | ast.IsNot):
                    flagged = _is_rule_name(left) or _is_rule_name(right)
                else:  # in / not in: a literal container of names is a branch on the name
                    container = isinstance(right, ast.Tuple | ast.List | ast.Set)
                    flagged = container and any(_is_rule_name(e) for e in right.elts)  # type: ignore[union-attr]
                if flagged:
                    lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _is_rule_name(node.value):
            lines.append(node.lineno)
    return lines


def test_no_module_outside_the_families_branches_on_a_rule_name() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "families":
            continue
        text = path.read_text()
        for line in name_branches(text):
            found.append(f"{path.relative_to(SRC.parent)}:{line}: {text.splitlines()[line - 1].strip()}")
    assert len(list(SRC.rglob("*.py"))) > 100  # the whole package was read
    assert not found, "ask the rule's family instead of its name:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_name_branch() -> None:
    planted = (
        'if rule.name == "mars": pass\n'
        "if name is RuleName.FLY: pass\n"
        'if kind in ("typical", "peer"): pass\n'
        'match name:\n    case "topk": pass\n'
        'if "strict" in summary: pass\n'  # a lookup, not a branch
        'if rule.margin == "logit_gap": pass\n'  # a margin, not a rule
    )
    assert name_branches(planted) == [1, 2, 3, 5]


def test_each_family_states_its_names_thetas_and_guards() -> None:
    names = [name for family in FAMILIES for name in family.names]
    assert sorted(names) == sorted(NAMES) and len(names) == len(set(names))  # each name in one family
    for family in FAMILIES:
        assert set(family.guards) <= set(GUARDS), family
        assert family.row_refusal is None or not family.lossless, family  # a lossless rule has no test
        for name in family.names:
            assert rule_family(name) is family
            if name in RULES and not family.lossless:  # a relaxing rule states what its theta means
                assert any(rule == name for rule, _ in THETA_MEANINGS), name


def test_a_rule_asks_its_family() -> None:
    fly = Rule("fly", 0.3, window=2)
    assert fly.family is rule_family("fly") and fly.family.takes_window and fly.family.row_refusal
    assert Rule("mars", 0.9, "logit_ratio").family.calibrates
    assert Rule("ensemble", 0.5).family.needs_draft_probs and Rule("block").family.judges_block
    assert RuleName("typical").family.needs_rows and not RuleName("mars").family.needs_rows
