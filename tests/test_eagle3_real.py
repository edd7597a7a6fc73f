"""EAGLE-3 heads on the REAL default target (Qwen2.5-Coder-1.5B-Instruct, fp32): heads in the published
format built here from the target's own output rows (tests/eagle3_heads.py says how they draft), loaded
from a folder and by Hub id from an offline cache. One prompt, few tokens: the target is the one the other
real-weights modules use (loaded once, tests/conftest.py), shared by every Decoder here.

Checked: strict verification of the head's drafts (chains and dynamic trees) equals plain decoding token
for token, with drafts accepted; MARS at theta 1 equals strict; MARS relaxes a head that drafts the
target's runner-up, first where strict took the target's top choice; a head made for another target is
refused in one line without loading weights.
"""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
import torch
from eagle3_heads import bigram_proposals, write_head
from test_hub import add_to_hub_cache

from marspec import Decoder, MarspecError
from marspec.models import DEFAULT_TARGET, resolve_model_dir

pytestmark = pytest.mark.real

PROMPT = "Write a Python function that returns the squares of a list of numbers."
NEW = 24
K = 4


@pytest.fixture(scope="module")
def plain(fp32_pair: Decoder) -> Decoder:
    return Decoder(fp32_pair.target, None)  # tests/conftest.py loads the target once per session


@pytest.fixture(scope="module")
def plain_run(plain) -> tuple[list[int], torch.Tensor]:
    """The plain greedy tokens and the target's top two at each of them."""
    tokens = plain.generate(PROMPT, rule="plain", max_new_tokens=NEW).token_ids
    from marspec.prompting import encode_prompt

    ids = encode_prompt(plain.tokenizer, PROMPT, plain.chat_default, plain.target.name)
    plain.target.reset()
    logits = plain.target.forward(torch.cat([ids, torch.tensor(tokens)]))
    plain.target.reset()
    top2 = logits.topk(2).indices[len(ids) - 1 : -1]
    assert top2[:, 0].tolist() == tokens
    return tokens, top2


@pytest.fixture(scope="module")
def heads(plain_run, tmp_path_factory) -> dict[str, object]:
    folder = resolve_model_dir(DEFAULT_TARGET)
    config = json.loads((folder / "config.json").read_text())
    tokens, top2 = plain_run
    root = tmp_path_factory.mktemp("heads")
    layers = [2, config["num_hidden_layers"] // 2, config["num_hidden_layers"]]
    made = {}
    for name, rank in (("top", 0), ("runner-up", 1)):
        proposals = bigram_proposals([tokens], [top2[:, rank].tolist()])
        made[name] = write_head(root / name, config, folder, proposals, layers=layers)
    made["cache"] = root / "hub"
    add_to_hub_cache(made["cache"], "marspec-test/qwen-eagle3", made["top"])
    return made


def test_strict_with_a_published_format_head_equals_plain(plain, plain_run, heads):
    decoder = Decoder(plain.target, str(heads["top"]), draft_confidence=0.0)
    result = decoder.generate(PROMPT, rule="strict", k=K, max_new_tokens=NEW)
    assert result.token_ids == plain_run[0]
    assert result.stats.accepted_exact > 0
    mars1 = decoder.generate(PROMPT, rule="mars", theta=1.0, k=K, max_new_tokens=NEW)
    assert mars1.token_ids == plain_run[0] and not mars1.relaxed_positions


def test_strict_and_mars_with_head_trees_equal_plain(plain, plain_run, heads):
    """The head's dynamic trees (EAGLE-2's expansion by cumulative confidence) on the real target."""
    decoder = Decoder(plain.target, str(heads["top"]), draft_confidence=0.0)
    result = decoder.generate(PROMPT, rule="strict", k=K, tree="3,2", max_new_tokens=NEW)
    assert result.token_ids == plain_run[0]
    assert result.stats.accepted_exact > 0
    mars1 = decoder.generate(PROMPT, rule="mars", theta=1.0, k=K, tree="3,2", max_new_tokens=NEW)
    assert mars1.token_ids == plain_run[0] and not mars1.relaxed_positions


def test_a_head_by_hub_id_offline_equals_its_folder(plain, plain_run, heads, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(heads["cache"]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    decoder = Decoder(plain.target, "marspec-test/qwen-eagle3", draft_confidence=0.0)
    result = decoder.generate(PROMPT, rule="strict", k=K, max_new_tokens=NEW)
    assert result.token_ids == plain_run[0] and result.stats.accepted_exact > 0


def test_mars_relaxes_a_head_drafting_the_runner_up(plain, plain_run, heads):
    decoder = Decoder(plain.target, str(heads["runner-up"]), draft_confidence=0.0)
    tokens, top2 = plain_run
    assert decoder.generate(PROMPT, rule="strict", k=1, max_new_tokens=NEW).token_ids == tokens
    result = decoder.generate(PROMPT, rule="mars", theta=0.0, margin="prob_ratio", k=1, max_new_tokens=NEW)
    assert result.relaxed_positions, "MARS relaxed no runner-up draft"
    first = next(i for i, (a, b) in enumerate(zip(result.token_ids, tokens, strict=False)) if a != b)
    assert first == result.relaxed_positions[0] and result.token_ids[first] == int(top2[first, 1])


def test_a_head_for_another_target_is_refused_before_loading(tmp_path, monkeypatch):
    """A head made for the tiny test target (64 wide, 96 tokens) against the real target: refused from
    the configs alone, in one line."""
    from eagle3_heads import last_layer_ids

    import marspec.api
    from marspec.selftest import save_tiny_model, tiny_model

    small = save_tiny_model(tmp_path / "small", tiny_model(seed=0, layers=4))
    head = write_head(
        tmp_path / "head",
        json.loads((small / "config.json").read_text()),
        small,
        {1: 2, 3: 4},
        layers=last_layer_ids(4),
    )

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the head was checked")

    monkeypatch.setattr(marspec.api, "load_lm", no_loading)
    with pytest.raises(MarspecError, match="hidden states 64 wide") as caught:
        Decoder(DEFAULT_TARGET, str(head))
    assert "\n" not in str(caught.value)
