"""Cadences slower than the tick, on a capability's injected clock: the one way periodic work is timed."""

from __future__ import annotations

import math


class Every:
    """Due once per period: at the first call, then at the first call a period or more after the last due one.

    Ticks that run late do not pile up: one late tick is one due, not a burst to catch up."""

    def __init__(self, period: float):
        self.period = period
        self._last = -math.inf

    def due(self, now: float) -> bool:
        if now - self._last < self.period:
            return False
        self._last = now
        return True

    def again(self) -> None:
        """Due at the next call whatever the period (a reload, hotplug: look again now)."""
        self._last = -math.inf
