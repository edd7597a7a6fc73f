"""A pair's load settings have one home (marspec.load_settings): Decoder's keywords default to its fields,
and the library and the CLI share one cache of the last pair loaded."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from marspec import api
from marspec.load_settings import LoadSettings
from marspec.selftest.tiny import noisy_copy, save_tiny_model, tiny_model


def test_decoders_keywords_default_to_the_load_settings():
    parameters = inspect.signature(api.Decoder.__init__).parameters
    for field in fields(LoadSettings):
        assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name
        assert parameters[field.name].default == field.default, field.name


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    target = tiny_model(seed=0)
    return str(save_tiny_model(tmp / "target", target)), str(
        save_tiny_model(tmp / "draft", noisy_copy(target, 1))
    )


def test_the_last_pair_loaded_is_reused_and_let_go_for_another(folders, monkeypatch):
    target, draft = folders
    monkeypatch.setattr(api, "_last_loaded", {})
    first = api.load_decoder(target, draft, "fp32", None, LoadSettings(device="cpu"))
    assert api.load_decoder(target, draft, "fp32", None, LoadSettings(device="cpu")) is first
    other = api.load_decoder(target, draft, "fp32", None, LoadSettings(device="cpu", lookup=True))
    assert other is not first and list(api._last_loaded.values()) == [other]  # one pair held at a time
    assert type(first.drafter).__name__ == "ModelDrafter" and type(other.drafter).__name__ == "HybridDrafter"
    assert api.loaded_decoder(target, draft, "fp32", None, LoadSettings(device="cpu", lookup=True)) is other
    assert api.loaded_decoder(target, draft, "fp32", None, LoadSettings(device="cpu")) is None
    # generate() loads through the same cache
    monkeypatch.setattr(api, "_last_loaded", {})
    out = api.generate("1 + 1 =", target=target, draft=draft, max_new_tokens=4, chat=False)
    assert len(out.token_ids) == 4 and len(api._last_loaded) == 1
