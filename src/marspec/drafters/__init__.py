"""Drafters: who proposes the tokens the target verifies."""

from marspec.drafters.base import Draft, Drafter
from marspec.drafters.hybrid import HybridDrafter
from marspec.drafters.model import ModelDrafter
from marspec.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "HybridDrafter", "ModelDrafter", "NgramDrafter"]
