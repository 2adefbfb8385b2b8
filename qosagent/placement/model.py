"""The placement capability's part of the Snapshot, its record of each process it tracks, and the typed commands
its decisions carry to apply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from qosagent.cpulist import format_cpulist
from qosagent.placement.discovery import ProcInfo
from qosagent.placement.planner import Target
from qosagent.placement.topology import Topology
from qosagent.snapshot import PartKey


@dataclass(frozen=True)
class Place:
    """Act on a selected process as planned: `pin` or `correct` it to the target's CPUs, `restore` its original
    affinity, or `leave` it where it is (recorded, nothing written)."""

    action: str
    proc: ProcInfo
    target: Target
    reason: str  # the record's: the target's, or what drifted


@dataclass(frozen=True)
class Drop:
    """Stop tracking a pid: it exited or names another program now, or (release) no selector names it any more and
    its original affinity goes back."""

    pid: int
    release: bool


@dataclass
class Record:
    """What placement knows and last did about one process."""

    pid: int
    start: int
    name: str
    selector: str
    gpus: tuple[int, ...] = ()
    node: int | None = None
    cpus: frozenset[int] | None = None  # the target; None: left where it was
    applied: bool = False  # the target was written (False in dry-run or after a failed write)
    last_action: str = ""
    reason: str = ""
    at: float = 0.0  # wall time of the last action
    threads: int = 0
    verified: bool | None = None  # every thread read back on target
    pages: dict[int, int] | None = None  # resident pages per node (numa_maps)
    locality_at: float = float("-inf")  # monotonic time pages were read

    @property
    def memory_local(self) -> float | None:
        if not self.pages or self.node is None:
            return None
        total = sum(self.pages.values())
        return self.pages.get(self.node, 0) / total if total else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "name": self.name, "selector": self.selector, "gpus": list(self.gpus),
            "node": self.node, "cpus": format_cpulist(self.cpus) if self.cpus is not None else None,
            "applied": self.applied, "last_action": self.last_action, "reason": self.reason, "time": self.at,
            "threads": self.threads, "verified": self.verified, "memory_local": self.memory_local,
            "pages": {str(n): p for n, p in sorted((self.pages or {}).items())},
        }


@dataclass(frozen=True)
class PlacementPart:
    """The placement part of a Snapshot."""

    mode: str
    topology: Topology
    reconcile: bool  # procs were discovered this tick (not while NVML's process lists are unknown)
    procs: tuple[ProcInfo, ...]
    records: tuple[dict[str, Any], ...]
    gone: frozenset[int] = frozenset()  # tracked pids whose process exited (reconcile ticks only)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    reserved_cpus: str = ""  # placement.reserved_cpus, as configured
    gpus: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # pid -> its GPUs (NVML), reconcile ticks


PLACEMENT = PartKey("placement", PlacementPart)
