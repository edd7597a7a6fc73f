"""A GGUF's header parsed once per conversion or load, by marspec's reads and transformers' alike.

gguf-py's ``GGUFReader`` parses every metadata field when it opens a file, one numpy memory-map slice per
string, so opening a Qwen2.5 GGUF (151,936 tokens and 151,387 merges in its tokenizer) costs ~13 s of one
core here whatever is read from it afterwards (the reader's known slowness, llama.cpp #13378).
transformers opens the file again for each thing it reads (the configuration, the tokenizer, the
configuration its tensor processors need), and marspec's own reads add to those: preparing a known model
reads its metadata, configuration and tokenizer, and writing its float32 weights or loading it in 4
bits reads the configuration that processes its tensors, and the tensors.

Inside :func:`one_parse_per_gguf`, ``gguf.GGUFReader`` (the name transformers imports when it reads a
GGUF, and marspec's readers too) answers a file the block has opened already with that reader. A file is
known by device, inode, size and modification time, so a renamed file (a conversion renames its folder
into place) is the same and a rewritten one is read again. The readers are read-only views of the file
and nothing in them changes as they are read. A parsed Qwen2.5 header holds ~0.5 GB of small arrays
until its block ends, so a block spans the reads, not the writing of weights. Each thread's block has
its own readers and opens outside a block parse as before; the name is gguf's own again when the last
open block ends. No lock is held across a block, so a block never waits on another (a conversion holds
a file lock around one).

Within a block, ``gguf.get_tensor_name_map`` (a model's GGUF tensor names, which transformers' mapping
of a model's weights, ``get_gguf_hf_weights_map``, builds again for each of the model's ~340 modules:
~5 s of a Qwen2.5's load) answers from the first build for the same architecture and layer count.

Most of a parse's time is numpy's memory-map class: the reader takes each of its ~900,000 small arrays
as a slice of an ``np.memmap``, whose slicing runs Python code. The readers made here
(:func:`gguf_reader`, and a block's) slice a plain array view of the same mapping instead, the same
bytes as the same arrays: 1.6 s instead of 7.7 for the 1.5B Qwen2.5's header (AMD EPYC Zen 4). That
takes over gguf's ``_get``, a private method; where it is not the one this module knows (its
parameters), the readers are gguf's own, as slow as before and as right.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Iterator
from typing import Any

_blocks = threading.local()  # .readers: this thread's open block's readers by file, or absent
_install_lock = threading.Lock()  # guards the three below, held only to swap the names
_open_blocks = 0  # blocks open in all threads; the names are swapped while there are any
_parse: Any = None  # gguf's own GGUFReader while the name is swapped
_name_map: Any = None  # gguf's own get_tensor_name_map while it is swapped


@contextlib.contextmanager
def one_parse_per_gguf() -> Iterator[None]:
    """Within the block (in this thread), opening a GGUF file it has opened already returns that reader."""
    if getattr(_blocks, "readers", None) is not None:  # a block inside a block shares its readers
        yield
        return
    _blocks.readers = {}
    _swap_name(+1)
    try:
        yield
    finally:
        _blocks.readers = None
        _swap_name(-1)


def _swap_name(change: int) -> None:
    """Count a block opening (+1) or ending (-1): the first swaps gguf's two names, the last restores them."""
    global _open_blocks, _parse, _name_map
    import gguf

    with _install_lock:
        if change > 0 and _open_blocks == 0:
            _parse, _name_map = gguf.GGUFReader, gguf.get_tensor_name_map
            gguf.GGUFReader = _reader_class(_parse)
            gguf.get_tensor_name_map = functools.cache(_name_map)
        _open_blocks += change
        if _open_blocks == 0:
            gguf.GGUFReader, gguf.get_tensor_name_map = _parse, _name_map
            _parse = _name_map = None


@functools.cache
def _fast_reader() -> Any:
    """gguf's reader, its small arrays sliced from a plain view of its memory map (see the module); gguf's
    own class where its ``_get`` is not the one known here."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself, whatever the package's name holds now

    known = ["self", "offset", "dtype", "count", "override_order"]
    if list(inspect.signature(GGUFReader._get).parameters) != known:
        return GGUFReader

    class FastReader(GGUFReader):  # type: ignore[misc, valid-type]
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:  # the map's bytes as an ndarray: the map stays open while a view of it lives
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            kind = np.dtype(dtype)
            array = plain[offset : offset + kind.itemsize * int(count)].view(kind)
            order = self.byte_order if override_order is None else override_order
            return array if order == "I" else array.view(kind.newbyteorder(order))

    return FastReader


def _reader_class(parse: Any) -> Any:
    class ParsedOnce(parse):  # type: ignore[misc, valid-type]
        # A subclass, so that isinstance checks and subclasses made meanwhile still work. A shared reader is
        # a plain GGUFReader, which Python does not __init__ (parse) again when __new__ returns it.
        def __new__(cls, path: os.PathLike[str] | str, mode: str = "r") -> Any:
            readers = getattr(_blocks, "readers", None)
            if cls is not ParsedOnce or readers is None or mode != "r":
                # Another's subclass, outside a block, or a writable view: an ordinary reader, not shared.
                return super().__new__(cls)
            st = os.stat(path)
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in readers:
                readers[key] = _fast_reader()(path)
            return readers[key]

    return ParsedOnce


def gguf_reader(path: os.PathLike[str] | str) -> Any:
    """A ``gguf.GGUFReader`` of ``path``: inside :func:`one_parse_per_gguf`, the block's one parse of it
    (the name is looked up at each call, so that a caller's import made before the block does not
    bypass it); outside one, a parse of its own. Either way the faster reader of the module."""
    import gguf

    if getattr(_blocks, "readers", None) is None:
        return _fast_reader()(path)
    return gguf.GGUFReader(path)
