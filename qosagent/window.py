"""Sliding windows over cumulative counters, one per key (tenant), that cost nothing for keys that do not change.

The kernel only ever adds; a key's window is `now - state(B)`, B being the window's start. Checkpoints are taken every
span/steps seconds and B is the newest one at least a span old (the first one, before a span has passed: the window
is then "since start"), so the window covers between span and span + span/steps seconds.

A key's state at a checkpoint is kept only when it changed since the one before: an idle key's state at B is its last
kept one at or before B, and zero before its first. A key's window changes in two ways only: its state changes, or B
passes one of its kept checkpoints (which a heap of them tells without looking at the other keys); `tick` returns the
keys the second happened to, so a caller rebuilds what it made of a window only for those and the changed ones.
"""

from __future__ import annotations

import collections
import heapq
from typing import Generic, Hashable, Iterable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Windows(Generic[K, T]):
    def __init__(self, span_s: float, zero: T, steps: int = 10):
        self.zero, self.steps = zero, steps
        self._current: dict[K, T] = {}
        self._restart(span_s)

    def _restart(self, span_s: float) -> None:
        self.span = span_s
        self.step = span_s / self.steps
        self._times: collections.deque[float] = collections.deque()  # the checkpoints, oldest first
        self._dirty: set[K] = set(self._current)  # changed since the last checkpoint
        self._kept: dict[K, collections.deque[tuple[float, T]]] = {}  # key -> its states at checkpoints, oldest first
        self._due: list[tuple[float, int, K]] = []  # (checkpoint time, seq, key): when B reaches it, key's base moves
        self._seq = 0

    @property
    def start(self) -> float:
        """B, the time the windows start at (as of the last tick)."""
        return self._times[0]

    def current(self, key: K) -> T:
        return self._current.get(key, self.zero)

    def base(self, key: K) -> T:
        """key's state at B."""
        kept = self._kept.get(key)
        if kept and kept[0][0] <= self._times[0]:
            return kept[0][1]
        return self.zero

    def keys(self) -> Iterable[K]:
        """Every key ever changed."""
        return self._current.keys()

    def tick(self, now: float, changed: Mapping[K, T]) -> set[K]:
        """Record the states that changed at now; the keys (of those that did not change) whose base moved."""
        self._current.update(changed)
        self._dirty.update(changed)
        times = self._times
        if not times or now - times[-1] >= self.step:
            times.append(now)
            for key in self._dirty:
                self._kept.setdefault(key, collections.deque()).append((now, self._current[key]))
                self._seq += 1
                heapq.heappush(self._due, (now, self._seq, key))
            self._dirty.clear()
        while len(times) > 1 and times[1] <= now - self.span:
            times.popleft()
        b = times[0]
        moved = set()
        while self._due and self._due[0][0] <= b:
            key = heapq.heappop(self._due)[2]
            kept = self._kept[key]
            while len(kept) > 1 and kept[1][0] <= b:  # the newest state at or before B is all B needs
                kept.popleft()
            if key not in changed:
                moved.add(key)
        return moved

    def restart(self, span_s: float) -> None:
        """A new span: the windows start again at the next tick, as the first did."""
        self._restart(span_s)
