"""Engines that compute logits with a KV cache (the protocol they implement: :class:`CausalLM`)."""

from marspec.backends.hf import HFCausalLM
from marspec.interfaces import CausalLM, ForwardClock

__all__ = ["CausalLM", "ForwardClock", "HFCausalLM"]
