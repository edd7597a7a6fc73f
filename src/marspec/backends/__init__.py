"""Engines that compute logits with a KV cache."""

from marspec.backends.base import CausalLM, ForwardClock
from marspec.backends.hf import HFCausalLM

__all__ = ["CausalLM", "ForwardClock", "HFCausalLM"]
