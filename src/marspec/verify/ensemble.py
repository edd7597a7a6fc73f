"""The ``ensemble`` rule's two tests at the verifiers' path: greedy, :func:`ensemble_choices`, and
sampled, :func:`ensemble_relaxes`. They read the draft's distribution, which only the verifiers have, so
the verifiers call them where the rule's family ``needs_draft_probs``; they are defined with the rest of
the family in :mod:`marspec.families.ensemble`.
"""

from marspec.families.ensemble import ensemble_choices as ensemble_choices
from marspec.families.ensemble import ensemble_relaxes as ensemble_relaxes
