"""What every verifier reads of how close the target's top two are: :func:`top2` and
:func:`margin_measure` (recorded for statistics whatever the rule), with MARS's close-call test beside
them. The margins and the test are MARS's family's (:mod:`marspec.families.mars`, where a margin is
defined once); this module is the verifiers' one path to them.
"""

from marspec.families.mars import close_call_accepts as close_call_accepts
from marspec.families.mars import is_close_call as is_close_call
from marspec.families.mars import margin_measure as margin_measure
from marspec.verify.top_tokens import top2 as top2  # every verifier's, defined there
