"""One immutable view of the host per tick, and the decisions taken on it.

Everything that reports (metrics, status, audit) and everything that decides reads a Snapshot; nothing else reaches
into the kernel or the hardware. Each capability contributes one part under its own name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Mapping, TypeVar, overload

T = TypeVar("T")


@dataclass(frozen=True)
class PartKey(Generic[T]):
    """A part's name in the Snapshot and its type, declared beside the type (each capability's and service's
    model.py: QUOTA = PartKey("quota", QuotaPart)): Snapshot.part(key) is typed per part, and checked, where a name
    alone gave Any."""

    name: str
    type: type[T]


@dataclass(frozen=True)
class Decision:
    """One change a capability decided, with what it saw and why: the unit of the audit ring."""

    capability: str
    target: str  # the tenant, CPU policy, GPU or process the decision is about
    action: str  # a short verb: cut, raise, shed, restore, set_freq, pin ...
    old: Any
    new: Any
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    applied: bool = True  # False in dry-run: computed and reported, not written
    wall_time: float = field(default_factory=time.time)
    # How the change reads for a person where old and new do not on their own (admission's None is "unlimited").
    shown: str = ""
    # What apply() carries out: the capability's own typed action. The rest of a Decision is its audit view, never
    # parsed back into a command.
    command: Any = field(default=None, compare=False, repr=False)

    def change(self) -> str:
        return self.shown or f"{'-' if self.old is None else self.old} -> {'-' if self.new is None else self.new}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "time": self.wall_time,
            "capability": self.capability,
            "target": self.target,
            "action": self.action,
            "old": self.old,
            "new": self.new,
            "reason": self.reason,
            "inputs": dict(self.inputs),
            "applied": self.applied,
            "change": self.change(),
        }


@dataclass(frozen=True)
class Snapshot:
    seq: int
    monotonic: float
    wall_time: float
    # Each part under its name, of the type its PartKey says: read it through part(key) to have that type.
    parts: Mapping[str, object]
    decisions: tuple[Decision, ...] = ()

    @staticmethod
    def build(seq: int, monotonic: float, wall_time: float, parts: Mapping[str, object]) -> "Snapshot":
        return Snapshot(seq, monotonic, wall_time, MappingProxyType(dict(parts)))

    @overload
    def part(self, key: PartKey[T]) -> T | None: ...

    @overload
    def part(self, key: str) -> object: ...

    def part(self, key: "PartKey[Any] | str") -> object:
        """The part of key's type (None when absent or of another type: a capability that failed to collect
        publishes nothing); by a bare name, whatever is there (a service's part, as the daemon iterates them)."""
        if isinstance(key, str):
            return self.parts.get(key)
        found = self.parts.get(key.name)
        return found if isinstance(found, key.type) else None
