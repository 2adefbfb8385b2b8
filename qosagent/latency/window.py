"""Sliding windows over cumulative counters: keep a few checkpoints, subtract the one a window ago.

The kernel only ever adds; a window is `now - checkpoint(now - span)`. Checkpoints are taken every span/steps
seconds, so the window covers between span and span + span/steps seconds, and costs `steps` copies of the state.
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class Window(Generic[T]):
    def __init__(self, span_s: float, steps: int = 10):
        self.span = span_s
        self.step = span_s / steps
        self._ring: collections.deque[tuple[float, T]] = collections.deque()

    def push(self, now: float, state: T) -> tuple[float, T]:
        """Record the state at `now`; returns (time, state) of the base to subtract for the window ending now.

        Before a full span has passed the base is the first state seen, so the window is "since start"."""
        if not self._ring or now - self._ring[-1][0] >= self.step:
            self._ring.append((now, state))
        # Keep the newest checkpoint that is at least a span old, and everything after it.
        while len(self._ring) > 1 and self._ring[1][0] <= now - self.span:
            self._ring.popleft()
        return self._ring[0]
