"""``plain``: decoding without a drafter. It verifies nothing, so it is a generation option, never a
:class:`marspec.rules.Rule`'s name: settled, it verifies as ``strict`` (a decoder without draft tokens
has nothing to relax) and needs no drafter."""

from __future__ import annotations

from marspec.families.strict import Lossless


class Plain(Lossless):
    names = ("plain",)
    verifies = False


PLAIN = Plain()
