"""Engines that compute logits with a KV cache."""

from marspec.backends.hf import HFCausalLM

__all__ = ["HFCausalLM"]
