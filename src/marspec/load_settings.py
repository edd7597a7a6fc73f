"""How a model pair is loaded: the drafter and kernel settings every model-loading entry point takes.

:class:`LoadSettings` is the one home of their defaults: :class:`marspec.api.Decoder`'s keyword arguments
of the same names default to its fields (tests/test_load_settings.py holds them equal), the CLI and the
server pass one, and the bench's harness loads with one. Importing it is cheap (no torch), so the command
line can build one at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from marspec.defaults import (
    DEFAULT_DRAFT_QUANT,
    DEFAULT_LOOKUP,
    DEFAULT_PREPACK,
    DEFAULT_TARGET_QUANT,
)


@dataclass(frozen=True)
class LoadSettings:
    """The drafter and kernel settings a pair is loaded with (:class:`marspec.api.Decoder` says what
    each one does). Frozen and hashable: the last pair loaded is kept by its settings."""

    draft_quant: str = DEFAULT_DRAFT_QUANT
    draft_confidence: float | None = None  # None: chosen from the machine's costs (marspec.draft_length)
    lookup: bool = DEFAULT_LOOKUP
    prepack: bool = DEFAULT_PREPACK
    device: str = "auto"
    target_quant: str = DEFAULT_TARGET_QUANT
    graphs: str = "auto"
