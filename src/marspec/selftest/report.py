"""What a self-test found: one :class:`Check` per property, and the :class:`SelftestReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Check:
    """One verdict: what was checked, whether it held, and the numbers behind it."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class SelftestReport:
    """What :func:`run_selftest` found: the device it ran on, each check, and the environment."""

    device: str
    checks: tuple[Check, ...]
    environment: dict[str, str]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}
