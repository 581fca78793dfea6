"""Fault points: named places inside every mutating operation where a test can make the cache fail.

The cache calls its ``fault_hook(point)`` at each point (a no-op by default). A `FaultInjector` counts the
points it passes and raises `InjectedFault` at the n-th, so a test can enumerate every point of an operation:
run it once with ``FaultInjector()`` to count them, then once per index with ``FaultInjector(fail_at=i)``.
"""
from .errors import InjectedFault


def no_fault(point: str) -> None:
    """The default hook: every fault point passes."""


class FaultInjector:
    """Raise `InjectedFault` at the ``fail_at``-th fault point (0-based); record every point passed."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.points: list[str] = []

    def __call__(self, point: str) -> None:
        index = len(self.points)
        self.points.append(point)
        if index == self.fail_at:
            raise InjectedFault(f"injected fault #{index} at {point!r}")
