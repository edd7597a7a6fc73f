"""The accept rules, one family to a file: each file holds its rules' names, what theta means under
each and its range, whether the family is lossless, what its test needs (the draft's distribution, the
target's whole row or only its top two) and the test itself.

- :mod:`.plain`: decoding without a drafter (a generation option, not a rule);
- :mod:`.strict`: lossless verification;
- :mod:`.mars`: MARS, the paper's close call on the target's top two, and its margins;
- :mod:`.rivals`: ``typical``, ``pthresh``, ``topk``, the rival lossy rules other engines ship;
- :mod:`.fly`: FLy's deferred mismatches;
- :mod:`.block`: block verification;
- :mod:`.ensemble`: the static ensemble of the target's and the draft's distributions;
- :mod:`.guards`: what narrows any rule's relaxed accepts.

:data:`FAMILIES` lists them in the order their names are listed to users. :mod:`marspec.rules` builds its
torch-free table (the names, the ranges the CLI checks) from them, and the verifiers and the vLLM plugin
ask a rule's family (:attr:`marspec.rules.Rule.family`) what to do rather than its name. Adding a rule:
docs/rules.md, "Adding a rule". Free of torch: the tests import it when they run.
"""

from marspec.families.base import Family
from marspec.families.block import BLOCK
from marspec.families.ensemble import ENSEMBLE
from marspec.families.fly import FLY
from marspec.families.mars import MARS
from marspec.families.plain import PLAIN
from marspec.families.rivals import RIVALS
from marspec.families.strict import STRICT

FAMILIES: tuple[Family, ...] = (PLAIN, STRICT, MARS, RIVALS, FLY, BLOCK, ENSEMBLE)

__all__ = ["FAMILIES", "Family"]
