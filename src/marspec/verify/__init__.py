"""Accept rules for speculative decoding: strict, MARS (margin-aware) and MARS's rivals.

Everything here is a small pure function over target logits: no model, no I/O, no Python loop over draft
positions. A decode step calls :func:`verify_greedy` (temperature 0) or :func:`verify_sampling`
(temperature > 0) with the target's logits for ``prefix + draft`` and gets back a :class:`Verification`;
which rule, and its settings, come in the :class:`~marspec.rules.Rule` it passes (checked apart, in
``marspec/rules.py``).

Shapes: ``K`` is the number of draft tokens, ``V`` the vocabulary size. ``target_logits`` is ``[K+1, V]``:
row ``i`` scores draft position ``i`` and row ``K`` is the bonus position.

Each rule's own test lives in its family's file (:mod:`marspec.families`); the verifiers ask the rule's
family what to do (``rule.family``), never its name:

- :mod:`.margins`: the target's top two and MARS's margins, which every verifier records;
- :mod:`.relax`: the one door to a family's test of where a rule accepts beyond the lossless test, and
  the guards;
- :mod:`.chain`: what the chain verifiers share (their outcome, checks, read-back and token draw);
- :mod:`.greedy`, :mod:`.sampling`, :mod:`.block`, :mod:`.tree`: the verifiers;
- :mod:`.ensemble`: the ensemble's tests, which read the draft's distribution, at the verifiers' path.

This package re-exports their public names, so ``from marspec.verify import verify_greedy`` and the
like keep one short path.
"""

from marspec.rules import Rule
from marspec.verify.block import block_acceptance, verify_block
from marspec.verify.chain import Verification, sample_token, to_host
from marspec.verify.chain import _sample as _sample  # read by tests/test_verify.py
from marspec.verify.ensemble import ensemble_choices
from marspec.verify.greedy import verify_greedy
from marspec.verify.margins import close_call_accepts, is_close_call, margin_measure, top2
from marspec.verify.relax import fly_defers, guarded, relaxed_accepts, rule_relaxes
from marspec.verify.sampling import verify_sampling
from marspec.verify.tree import TreeVerification, verify_tree_greedy

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
