"""How the plugin wraps a vLLM function in place: once per process, and undoably readable."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

WRAPPED = "_marspec_wrapped"  # set on every wrapper, so a second register() wraps nothing twice


def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``make(original)``, unless the plugin has already wrapped it."""
    original = getattr(owner, name)
    if getattr(original, WRAPPED, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, WRAPPED, True)
    setattr(owner, name, wrapper)


def unwrapped(function: Any) -> Any:
    """vLLM's own function behind the plugin's wrapper (``function`` itself when unwrapped)."""
    return function.__wrapped__ if getattr(function, WRAPPED, False) else function
