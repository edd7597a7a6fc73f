"""oneDNN-prepacked weights for linear layers: multi-token forwards that cost little more than one.

Speculative decoding pays only if verifying n drafted tokens costs about as much as decoding one. With
torch's default CPU path (MKL sgemm, which repacks the weight matrix on every call) a forward of the
1.5B Qwen target over 9-21 tokens cost 3-4 one-token steps on this machine's AMD EPYC. Reordering each
weight once into oneDNN's blocked layout, as torch's own inductor does when it freezes a model for CPU,
brings a 21-token forward down to ~1.3 one-token steps and makes the one-token step itself ~20% cheaper
(docs/results.md, "Prepacked kernels"). The arithmetic is the same matrix product in fp32 (bf16 for a bf16
model), summed in a different order: logits move by ~1e-4, as between any two BLAS libraries.
"""

from __future__ import annotations

import torch

from marspec.backends.memory import own_remaining_tensors, rewrite_linears


def prepack_available() -> bool:
    """Whether this torch build can run oneDNN-prepacked linear layers on this CPU."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PrepackedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight held in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # An opaque oneDNN tensor: [out, in] logically, blocked in memory; it replaces the dense weight.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        # A copy: a view would keep the whole checkpoint file mapped (see prepack_linears).
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-prepacked"


def prepack_linears(model: torch.nn.Module) -> int:
    """Replace every fp32 or bf16 ``nn.Linear`` in ``model`` with a :class:`PrepackedLinear`, in place.

    Returns how many layers were replaced (0 where oneDNN is unavailable: the model is then left as it
    was). Quantised layers are not ``nn.Linear`` and are left alone. A weight tied to the input
    embeddings (Qwen's LM head) is copied into the packed layout, so the embedding keeps its own. Memory
    stays about what the unpacked model takes, while packing too (:mod:`marspec.backends.memory`).
    """
    if not prepack_available():
        return 0
    replaced = rewrite_linears(
        model,
        PrepackedLinear,
        "cannot prepack {name} with {dtype} weights: load the model in fp32 or bf16, or turn prepacking "
        "off (prepack=False, --no-prepack)",
    )
    if replaced:
        # The packed weights are copies; the few tensors still viewing the checkpoint file (embeddings,
        # norms) would keep its whole mapping: copy them out and let it go.
        own_remaining_tensors(model)
    return replaced
