"""The fixed-shape path (``graphs="on"``) on the REAL Qwen2.5-Coder pair in fp32: strict equals plain and
MARS at theta 1 equals strict, chains and trees, greedy; with an EAGLE-3 head drafting from the fixed-shape
target's kept hidden states; and with the int8 and int4 targets (each its own model: strict equals its own
plain decoding). One prompt, few tokens."""

from __future__ import annotations

import json

import pytest
from eagle3_heads import bigram_proposals, write_head

from marspec import Decoder
from marspec.backends.fixed import FixedShapeLM
from marspec.backends.int4 import int4_available
from marspec.backends.quantize import rowwise_int8_available
from marspec.batch.slots import batched_form
from marspec.models import DEFAULT_TARGET, resolve_model_dir

pytestmark = pytest.mark.real

PROMPT = "Write a Python function `merge_sorted(a, b)` that merges two sorted lists, with a docstring."
SETTINGS = {
    "plain": {"rule": "plain"},
    "strict": {"rule": "strict"},
    "mars1": {"rule": "mars", "theta": 1.0},
    "strict_tree": {"rule": "strict", "tree": "2,2"},
    "mars1_tree": {"rule": "mars", "theta": 1.0, "tree": "2,2"},
}
QUANTS = [
    pytest.param("int8", marks=pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8")),
    pytest.param("int4", marks=pytest.mark.skipif(not int4_available(), reason="no int4 CPU kernels")),
]


def on_the_fixed_path(pair: Decoder) -> Decoder:
    """A loaded pair's models (tests/conftest.py loads each once) behind the fixed-shape backend: the same
    weights, the fixed path's own caches."""
    decoder = Decoder(pair.target, pair.drafter.draft_model, graphs="on")
    assert isinstance(decoder.target, FixedShapeLM) and isinstance(decoder.drafter.draft_model, FixedShapeLM)
    return decoder


@pytest.mark.parametrize("quant", QUANTS)
def test_a_quantised_target_on_the_fixed_path_keeps_strict_equal_to_its_plain_decoding(quant, request):
    decoder = on_the_fixed_path(request.getfixturevalue(f"{quant}_pair"))
    plain = decoder.generate(PROMPT, rule="plain", max_new_tokens=16).token_ids
    for name in ("strict", "mars1"):
        run = decoder.generate(PROMPT, k=5, max_new_tokens=16, **SETTINGS[name])
        assert run.token_ids == plain, name
        assert run.stats.accepted_exact > 0


@pytest.fixture(scope="module")
def decoder(fp32_pair: Decoder) -> Decoder:
    return on_the_fixed_path(fp32_pair)


@pytest.fixture(scope="module")
def runs(decoder) -> dict[str, list[int]]:
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


def test_an_eagle3_head_on_the_fixed_path_keeps_strict_equal_to_plain(decoder, runs, tmp_path):
    """A head (tests/eagle3_heads.py) proposing what plain decoding took, drafting from the hidden states
    the fixed-shape target writes at its slots: strict equals plain with drafts accepted, MARS at theta 1
    equals strict."""
    folder = resolve_model_dir(DEFAULT_TARGET)
    config = json.loads((folder / "config.json").read_text())
    plain = runs["plain"]
    layers = [2, config["num_hidden_layers"] // 2, config["num_hidden_layers"]]
    head = write_head(tmp_path / "head", config, folder, bigram_proposals([plain], [plain]), layers=layers)
    with_head = Decoder(decoder.target, str(head), graphs="on", draft_confidence=0.0)
    assert with_head.target is decoder.target  # already on the fixed path: the same model, not a copy
    strict = with_head.generate(PROMPT, rule="strict", k=4, max_new_tokens=32)
    assert strict.token_ids == plain and strict.stats.accepted_exact > 0
    mars1 = with_head.generate(PROMPT, rule="mars", theta=1.0, k=4, max_new_tokens=32)
    assert mars1.token_ids == plain and not mars1.relaxed_positions


def test_sequences_decoded_together_on_the_fixed_path_decode_as_each_does_alone(fp32_pair, runs):
    """The fixed-shape path with a batch dimension (issue 69's GPU half, run here uncaptured): the
    runs' settings decoded three at a time in batched forwards, a chain, a token tree and MARS at theta 1
    beside each other and beside another prompt; each equals its solo decode token for token, so strict
    equals plain and MARS at theta 1 equals strict inside the batch too. The int8 draft scales each
    forward's activations as a whole, so its forwards run one sequence at a time. A fixed-shape view of
    its own: the module's keeps an EAGLE-3 head's hidden states once the head's test has run."""
    decoder = on_the_fixed_path(fp32_pair)
    assert batched_form(decoder.target) == "fixed"
    other = "Explain what a Python generator is, in two sentences."
    names = ["strict", "strict_tree", "mars1", "mars1_tree"]
    prompts = [PROMPT] * len(names) + [other]
    settings = [{**SETTINGS[name], "k": 5, "max_new_tokens": 32} for name in names]
    settings.append({"rule": "plain", "max_new_tokens": 24})
    together = decoder.generate_many(prompts, max_batch=3, per_prompt=settings)
    assert [r.token_ids for r in together[:-1]] == [runs["plain"]] * len(names)
    assert all(r.stats.accepted_exact > 0 for r in together[:-1])
    assert together[-1].token_ids == decoder.generate(other, **settings[-1]).token_ids
