"""Drafters: who proposes the tokens the target verifies (the protocol they implement: :class:`Drafter`)."""

from marspec.drafters.eagle3 import Eagle3Drafter
from marspec.drafters.hybrid import HybridDrafter
from marspec.drafters.model import ModelDrafter
from marspec.drafters.ngram import NgramDrafter
from marspec.interfaces import Draft, Drafter

__all__ = ["Draft", "Drafter", "Eagle3Drafter", "HybridDrafter", "ModelDrafter", "NgramDrafter"]
