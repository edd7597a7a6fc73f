"""``strict``: lossless verification. Greedy, a draft token is accepted while it is the target's top-1
(plain greedy decoding's tokens, one for one); sampling, by the Leviathan/Chen test (the target's
distribution exactly). It never relaxes, so it has no test of its own: the verifiers' lossless test is
all of it. A theta it is given with a margin is checked as MARS's on that margin (the setting is echoed
and recorded whole), and means nothing; :class:`Lossless` is that much, for every lossless family."""

from __future__ import annotations

from typing import ClassVar

from marspec.families.base import Family, ThetaMeaning, ThetaTable
from marspec.families.mars import MARGIN_THETAS


class Lossless(Family):
    """A family that never relaxes: a theta given to it is checked as MARS's on the margin."""

    lossless = True

    def theta_meaning(self, name: str, margin: str | None) -> ThetaMeaning:
        return MARGIN_THETAS[margin]  # type: ignore[index]  # Rule checks a margin is named first


class Strict(Lossless):
    names = ("strict",)
    # Listed in the table of what theta means (the lossless rules' row: checked as MARS's).
    thetas: ClassVar[ThetaTable] = {("strict", margin): meaning for margin, meaning in MARGIN_THETAS.items()}


STRICT = Strict()
