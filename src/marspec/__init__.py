"""marspec: speculative decoding with margin-aware verification (MARS).

    >>> import marspec
    >>> out = marspec.generate("Write a haiku about caches.", rule="mars", theta=0.9)
    >>> out.text, out.stats.tau

The heavy parts (torch, transformers) are imported on first use, so ``marspec --help`` stays quick.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from marspec.errors import MarspecError
from marspec.version import __version__

_LAZY = {
    "generate": "marspec.api",
    "Decoder": "marspec.api",
    "GenerationOptions": "marspec.api",
    "GenerationResult": "marspec.api",
    "GenerationStream": "marspec.api",
    "TokenLogprob": "marspec.api",
    "GenerationStats": "marspec.stats",
    "Rule": "marspec.rules",
    "RuleName": "marspec.rules",
    "Margin": "marspec.rules",
    "Guard": "marspec.rules",
    "verify_greedy": "marspec.verify",
    "verify_sampling": "marspec.verify",
    "verify_tree_greedy": "marspec.verify",
    "DraftTree": "marspec.interfaces",
    "MODELS": "marspec.models",
    "DEFAULT_TARGET": "marspec.models",
    "DEFAULT_DRAFT": "marspec.models",
}

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "MODELS",
    "Decoder",
    "DraftTree",
    "GenerationOptions",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "Guard",
    "Margin",
    "MarspecError",
    "Rule",
    "RuleName",
    "TokenLogprob",
    "__version__",
    "generate",
    "verify_greedy",
    "verify_sampling",
    "verify_tree_greedy",
]

if TYPE_CHECKING:
    from marspec.api import (
        Decoder,
        GenerationOptions,
        GenerationResult,
        GenerationStream,
        TokenLogprob,
        generate,
    )
    from marspec.interfaces import DraftTree
    from marspec.models import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS
    from marspec.rules import Guard, Margin, Rule, RuleName
    from marspec.stats import GenerationStats
    from marspec.verify import verify_greedy, verify_sampling, verify_tree_greedy


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'marspec' has no attribute {name!r}")
