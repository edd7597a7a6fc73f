"""Reading a model's tokenizer without its weights, to refuse a draft whose tokens mean something else
than the target's before either model loads (loading a pair takes seconds to minutes and gigabytes; two
tokenizers take about a second).

Where the tokenizer comes from, by how the model is named (as :func:`~marspec.models.resolve_model_dir`
takes it): a local folder or a converted known model, its folder; a ``.gguf`` file not converted yet, the
GGUF's own metadata (no weights are read or converted); a Hugging Face Hub id, its configuration and
tokenizer files only (downloaded without the weights when online). A known name that was never
converted is converted first, once, as any use of it would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from marspec.errors import MarspecError, one_line
from marspec.models.cache import gguf_cache_key, models_root
from marspec.models.convert import quiet_transformers, read_gguf_metadata, resolve_model_dir
from marspec.models.gguf_parse import one_parse_per_gguf
from marspec.models.hub import hub_snapshot, names_hub_model
from marspec.models.registry import MODELS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def read_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a model named as :func:`~marspec.models.resolve_model_dir` takes it, read without
    loading, converting or downloading its weights (see the module's docstring for each form)."""
    text = os.fspath(name_or_path)
    if text not in MODELS and names_hub_model(name_or_path):
        return _read_tokenizer(text, hub_snapshot(text, weights=False), None)
    # An unconverted GGUF is opened by its check and again by the tokenizer's read: one parse serves both.
    with one_parse_per_gguf():
        gguf = _unconverted_gguf(text)
        if gguf is not None:
            return _read_tokenizer(text, gguf.parent, gguf)
    return _read_tokenizer(text, resolve_model_dir(name_or_path), None)


def _read_tokenizer(text: str, folder: Path, gguf: Path | None) -> PreTrainedTokenizerBase:
    """The tokenizer in ``folder`` (from its file ``gguf`` if given), or a one-line error naming ``text``."""
    from transformers import AutoTokenizer

    where = gguf if gguf is not None else folder
    try:
        with quiet_transformers():
            if gguf is not None:
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name, local_files_only=True)
            else:
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises assorted errors on missing or damaged files
        raise MarspecError(
            f"cannot read the tokenizer of {text!r} from {where} ({one_line(exc)}): check that it is a "
            "complete model"
        ) from exc
    if len(tokenizer) < 2:  # transformers builds an empty tokenizer for a folder without tokenizer files
        raise MarspecError(
            f"cannot read the tokenizer of {text!r} from {where}: it has no tokenizer files "
            "(tokenizer.json, tokenizer_config.json, ...); check that it is a complete model"
        )
    return tokenizer


def _unconverted_gguf(text: str) -> Path | None:
    """The user's ``.gguf`` file that ``text`` names, if it has not been converted into the cache yet
    (once converted, its folder is read like any other)."""
    if text in MODELS:
        return None
    path = Path(text).expanduser()
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    path = path.resolve()
    if (models_root() / gguf_cache_key(path)).is_dir():
        return None
    read_gguf_metadata(path, f"delete or replace {path} with a complete GGUF file")  # a one-line error
    return path


def check_draft_tokenizer(
    target: str | os.PathLike[str] | PreTrainedTokenizerBase,
    draft: str | os.PathLike[str] | PreTrainedTokenizerBase,
    target_name: str,
    draft_name: str,
) -> None:
    """Refuse, in one line, a draft model whose tokenizer is not the target's: its token ids would mean
    other text, so every draft would be wrong (or out of range). Each model is a name or path (its
    tokenizer is read without its weights, :func:`read_tokenizer`) or a tokenizer already loaded."""
    names = (target, draft)
    if all(isinstance(n, (str, os.PathLike)) for n in names) and os.fspath(target) == os.fspath(draft):
        return  # a model drafting for itself (as tests and benchmarks do)
    target_vocab = _tokenizer(target).get_vocab()
    if _tokenizer(draft).get_vocab() != target_vocab:
        raise MarspecError(
            f"draft model {draft_name!r} does not share the tokenizer of target {target_name!r}: their "
            "token ids mean different things; pick a draft from the target's family or use draft='ngram'"
        )


def _tokenizer(
    model: str | os.PathLike[str] | PreTrainedTokenizerBase,
) -> PreTrainedTokenizerBase:
    return read_tokenizer(model) if isinstance(model, (str, os.PathLike)) else model
