"""A draft whose tokenizer is not the target's is refused before any weights load, in one line: by the
library (Decoder), the CLI (exit 2) and the server (at start-up).

Every test here makes loading weights fail loudly (``weights_never_load``), so a refusal that came after
a load could not pass. The tiny models are built here, and the drafts that must be refused have no
weights at all: a folder with only its configuration and tokenizer, an unconverted .gguf (which must not
be converted), a Hub snapshot without safetensors. The real tokenizers (SmolLM2 against the Qwen pair)
are in the tests marked ``real``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers
from conftest import SMALL
from test_hub import add_to_hub_cache
from test_models import write_tiny_gguf
from typer.testing import CliRunner

from marspec.api import Decoder, load_lm
from marspec.cli import app
from marspec.errors import MarspecError
from marspec.eval.peak_memory import run_measured
from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from marspec.models.cache import models_root
from marspec.models.tokenizers import check_draft_tokenizer, read_tokenizer
from marspec.selftest import save_tiny_model, tiny_model
from marspec.selftest.tiny import tiny_tokenizer

runner = CliRunner()
HUB_DRAFT = "marspec-test/other-tokenizer"
MISMATCH = "does not share the tokenizer of target"


@pytest.fixture
def weights_never_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' loader of causal-LM weights, made to fail: every model marspec loads goes through
    it (marspec.models.loading.load_model)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"weights were loaded: {args[:1]}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def other_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny tokenizer's characters under other ids (its vocabulary reversed): the same text, other
    token ids, as between two model families."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tiny = tiny_tokenizer()
    vocab = {token: len(tiny) - 1 - i for token, i in tiny.get_vocab().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    eos = tiny.eos_token
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, unk_token=eos, pad_token=eos
    )


def without_weights(model_folder: Path, out: Path, tokenizer=None) -> Path:
    """A model folder holding only ``model_folder``'s config.json and a tokenizer (its own by default)."""
    out.mkdir(parents=True)
    shutil.copy(model_folder / "config.json", out / "config.json")
    (tokenizer or transformers.AutoTokenizer.from_pretrained(model_folder)).save_pretrained(out)
    return out


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A tiny target with weights, and drafts without any: one sharing its tokenizer, one with another
    tokenizer (a folder), an unconverted .gguf, and a Hub snapshot with another tokenizer (offline)."""
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    target = save_tiny_model(tmp_path / "target", tiny_model(seed=0))
    other = without_weights(target, tmp_path / "other", other_tokenizer())
    hub = tmp_path / "hub"
    add_to_hub_cache(hub, HUB_DRAFT, other)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return {
        "target": target,
        "same": without_weights(target, tmp_path / "same"),
        "other": other,
        "gguf": write_tiny_gguf(tmp_path / "tiny.gguf"),
    }


def test_a_draft_sharing_the_tokenizer_passes_the_check(models) -> None:
    check_draft_tokenizer(str(models["target"]), str(models["same"]), "target", "same")


def test_a_draft_model_checked_to_share_the_tokenizer_loads_with_the_targets_own(models) -> None:
    """One tokenizer in memory for the pair, not two (a Qwen2.5 tokenizer holds ~0.1 GB)."""
    draft = save_tiny_model(models["same"].parent / "draft", tiny_model(seed=1))
    decoder = Decoder(str(models["target"]), str(draft), device="cpu")
    assert decoder.drafter is not None and decoder.drafter.draft_model.tokenizer is decoder.tokenizer


@pytest.mark.parametrize("draft", ["other", "gguf", "hub"])
def test_the_library_refuses_a_mismatch_before_loading_weights(models, weights_never_load, draft) -> None:
    name = HUB_DRAFT if draft == "hub" else str(models[draft])
    with pytest.raises(MarspecError, match=MISMATCH) as caught:
        Decoder(str(models["target"]), name, device="cpu")
    assert "\n" not in str(caught.value) and repr(name) in str(caught.value)
    assert not any(models_root().glob("gguf-*"))  # the .gguf was read, not converted


def test_a_loaded_target_is_checked_against_a_draft_by_name(models, request) -> None:
    target, _ = load_lm(str(models["target"]), torch.float32)
    request.getfixturevalue("weights_never_load")  # from here on: the draft must not load
    with pytest.raises(MarspecError, match=MISMATCH):
        Decoder(target, str(models["other"]), device="cpu")


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"]])
def test_the_cli_and_the_server_refuse_a_mismatch_in_one_line(models, weights_never_load, command) -> None:
    args = [*command, "--target", str(models["target"]), "--draft", str(models["gguf"])]
    result = runner.invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: draft model") and MISMATCH in lines[0], lines


def test_read_tokenizer_names_a_model_without_one(tmp_path) -> None:
    folder = save_tiny_model(tmp_path / "m", tiny_model(seed=0))
    for file in folder.glob("tokenizer*"):
        file.unlink()
    with pytest.raises(MarspecError, match="cannot read the tokenizer") as caught:
        read_tokenizer(str(folder))
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------------------------------
# Real tokenizers: SmolLM2's is not the Qwen pair's


@pytest.mark.real
@pytest.mark.parametrize(
    ("target", "draft"), [(SMALL, DEFAULT_DRAFT), (DEFAULT_TARGET, SMALL), (SMALL, DEFAULT_TARGET)]
)
def test_real_tokenizers_that_differ_are_refused_before_loading(weights_never_load, target, draft) -> None:
    with pytest.raises(MarspecError, match=MISMATCH):
        Decoder(target, draft, device="cpu")


@pytest.mark.real
def test_the_real_pair_shares_its_tokenizer() -> None:
    check_draft_tokenizer(DEFAULT_TARGET, DEFAULT_DRAFT, DEFAULT_TARGET, DEFAULT_DRAFT)


@pytest.mark.real
def test_the_cli_refuses_a_real_mismatch_in_the_memory_of_two_tokenizers() -> None:
    """The 1.5B target in fp32 alone takes over 6 GB; refused on its tokenizer, the whole command's
    peak stays near that of importing torch and transformers and reading two tokenizers (~0.5 GB)."""
    args = ["generate", "hi", "--target", DEFAULT_TARGET, "--draft", SMALL, "--device", "cpu"]
    out = run_measured(args, timeout=600)  # the command's own peak (VmHWM), not its parent's
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: draft model") and MISMATCH in lines[0], out.stderr
    assert out.peak_gib is not None
    peak_gib = out.peak_gib
    assert peak_gib < 2.0, f"peak {peak_gib:.2f} GiB: the weights were loaded"
