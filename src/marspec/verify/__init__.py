"""Accept rules for speculative decoding (transitional: the whole of it is in :mod:`.relax` until split)."""

from marspec.rules import Rule
from marspec.verify.relax import (
    TreeVerification,
    Verification,
    block_acceptance,
    close_call_accepts,
    ensemble_choices,
    fly_defers,
    guarded,
    is_close_call,
    margin_measure,
    relaxed_accepts,
    rule_relaxes,
    sample_token,
    to_host,
    top2,
    verify_block,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
)
from marspec.verify.relax import (
    _sample as _sample,
)

__all__ = [
    "Rule",
    "TreeVerification",
    "Verification",
    "block_acceptance",
    "close_call_accepts",
    "ensemble_choices",
    "fly_defers",
    "guarded",
    "is_close_call",
    "margin_measure",
    "relaxed_accepts",
    "rule_relaxes",
    "sample_token",
    "to_host",
    "top2",
    "verify_block",
    "verify_greedy",
    "verify_sampling",
    "verify_tree_greedy",
]
