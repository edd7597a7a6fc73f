"""The fixed-shape path (``graphs="on"``) on the REAL Qwen2.5-Coder pair in fp32: strict equals plain and
MARS at theta 1 equals strict, chains and trees, greedy. One prompt, 32 tokens: about a minute of CPU."""

from __future__ import annotations

import pytest

from marspec import Decoder
from marspec.backends.fixed import FixedShapeLM
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET

pytestmark = pytest.mark.real

PROMPT = "Write a Python function `merge_sorted(a, b)` that merges two sorted lists, with a docstring."
SETTINGS = {
    "plain": {"rule": "plain"},
    "strict": {"rule": "strict"},
    "mars1": {"rule": "mars", "theta": 1.0},
    "strict_tree": {"rule": "strict", "tree": "2,2"},
    "mars1_tree": {"rule": "mars", "theta": 1.0, "tree": "2,2"},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[int]]:
    decoder = Decoder(DEFAULT_TARGET, DEFAULT_DRAFT, dtype="fp32", graphs="on")
    assert isinstance(decoder.target, FixedShapeLM) and isinstance(decoder.drafter.draft_model, FixedShapeLM)
    return {
        name: decoder.generate(PROMPT, k=5, max_new_tokens=32, **options).token_ids
        for name, options in SETTINGS.items()
    }


@pytest.mark.parametrize("name", ["strict", "strict_tree"])
def test_strict_equals_plain_on_the_fixed_path(runs, name):
    assert runs[name] == runs["plain"]


@pytest.mark.parametrize(("name", "reference"), [("mars1", "strict"), ("mars1_tree", "strict_tree")])
def test_mars_at_theta_one_equals_strict_on_the_fixed_path(runs, name, reference):
    assert runs[name] == runs[reference]
