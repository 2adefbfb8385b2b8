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


class Pace:
    """The control loop's wait between ticks: `interval` while anything moves; once the ticks have found nothing new
    and left nothing pending for `rest` seconds in a row, `rest`, until the first tick that finds something.

    At rest every capability's next decision waits on new inputs alone (Capability.quiet), so a longer wait moves
    no decision but in time, by at most `rest`; what a tick costs is then paid a few times a second instead of ten.
    A `rest` no longer than `interval` never rests."""

    def __init__(self, interval: float, rest: float):
        self.interval, self.rest = interval, rest
        self.resting = False
        self._quiet_since: float | None = None

    @property
    def period(self) -> float:
        return self.rest if self.resting else self.interval

    def after(self, now: float, quiet: bool) -> float:
        """The wait before the next tick, given whether the tick run at `now` was quiet."""
        if not quiet or self.rest <= self.interval:
            self._quiet_since, self.resting = None, False
        elif self._quiet_since is None:
            self._quiet_since = now
        else:
            self.resting = now - self._quiet_since >= self.rest
        return self.period

    def again(self, interval: float, rest: float) -> None:
        """New periods (a reload), awake: the reload itself is news."""
        self.interval, self.rest = interval, rest
        self._quiet_since, self.resting = None, False
