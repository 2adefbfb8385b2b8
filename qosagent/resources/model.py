"""The resources capability's part of the Snapshot (its serving process groups, what was set on them, what the
kernel reports back, the suppression in force) and the typed commands its decisions carry to apply."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Mapping

from qosagent.snapshot import PartKey

# A group's state, the status column STATE and the metric label `state`.
OK = "ok"  # ours to set: its processes serve one tier and nothing else is in it
SHARED = "shared"  # the root, a slice, a login session or processes of no tier: reported (moved with move: true)
CONFLICT = "conflict"  # serving processes of two tiers in one cgroup: reported, left
KUBELET = "kubelet"  # a kubelet-owned pod cgroup with kubelet_cgroups: report
BACKED_OFF = "backed_off"  # someone rewrote what we set: left to them
MOVED = "moved"  # shared, its serving processes moved into a cgroup of ours (move: true)
UNAVAILABLE = "unavailable"  # cgroup v2: the controller is not enabled for this cgroup (never enabled by us)


@dataclass(frozen=True)
class Serving:
    """One serving process: a process listening on a tenant's port, or in a namespace its process/pods rule
    matches."""

    pid: int
    start: int  # its start time in ticks (/proc/PID/stat): a reused pid is another process
    name: str
    tenant: str
    tier: str


@dataclass(frozen=True)
class Group:
    """The serving processes of one cgroup, for one controller (cpu or memory): what the files are set on."""

    controller: str  # cpu, memory
    version: str  # v2, v1
    path: str  # the cgroup's path in the hierarchy, as the host names it
    directory: str  # its host directory
    tiers: tuple[str, ...]  # the tiers whose serving processes are in it (more than one: CONFLICT)
    pids: tuple[int, ...]  # the serving processes in it
    state: str
    why: str = ""
    others: int = 0  # processes in it that serve no tier

    @property
    def key(self) -> str:
        return f"{self.controller}:{self.path}"

    @property
    def tier(self) -> str:
        return self.tiers[0] if len(self.tiers) == 1 else ""


@dataclass(frozen=True)
class Files:
    """Set one group's controller files to these values (in this order), after saving their originals; on a
    refusal part-way, what was written of them goes back."""

    group: Group
    values: tuple[tuple[str, str], ...]  # (file name, value)


@dataclass(frozen=True)
class Move:
    """Move a shared group's serving processes into the agent's own cgroup of their tier (qosagent-<tier>)."""

    group: Group
    by_tier: tuple[tuple[str, tuple[int, ...]], ...]  # (tier, its serving pids in the group)


@dataclass(frozen=True)
class Release:
    """Put back what was set in a cgroup: its serving processes left it, or their tier no longer asks."""

    group: Group


@dataclass(frozen=True)
class BackOff:
    """Someone else rewrote what was set (the kubelet, systemd): their values stay, the group is left to them."""

    group: Group
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Sched:
    """Give every thread of these processes the tier's scheduler hint (threads born later get it at the next
    reconcile); hint None: their threads back to their originals."""

    tier: str
    pids: tuple[int, ...]
    hint: "Hint | None"


@dataclass(frozen=True)
class Hint:
    """The scheduling a tier's serving threads get: a policy (normal, batch, idle), and for latency-sensitive tiers a
    custom slice in ns where the kernel takes one, else a nice value."""

    policy: str
    slice_ns: int = 0
    nice: int | None = None

    def shown(self) -> str:
        if self.slice_ns:
            return f"slice {self.slice_ns / 1e6:g}ms"
        if self.nice is not None:
            return f"nice {self.nice}"
        return self.policy


@dataclass(frozen=True)
class GroupReport:
    """A group as status and metrics show it: what was set, and what the kernel reports back."""

    group: Group
    set: Mapping[str, str] = field(default_factory=dict)  # file -> value written (or that would be, in dry-run)
    applied: bool = False
    error: str = ""
    throttled: Mapping[str, int] = field(default_factory=dict)  # nr_periods, nr_throttled, throttled_usec
    memory_events: Mapping[str, int] = field(default_factory=dict)  # high, max, oom, oom_kill (v2); failcnt (v1)


@dataclass(frozen=True)
class TierReport:
    tier: str
    groups: int
    quota_cpus: float | None  # the cpu.max in force from suppression; None: as configured
    configured_cpus: float | None
    step: int  # suppression steps in force (0: none)
    hint: str  # the scheduler hint its serving threads get
    threads: int  # serving threads given it
    usage_cpus: float | None = None  # CPUs its serving processes used over the last reconcile


@dataclass(frozen=True)
class ResourcesPart:
    mode: str
    enforcing: bool
    reconcile: bool  # found, serving, rewritten and usage were read this tick
    found: tuple[Group, ...] = ()
    serving: tuple[Serving, ...] = ()
    rewritten: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # group key -> files someone else set
    usage: Mapping[str, float] = field(default_factory=dict)  # tier -> CPUs its serving processes used
    # The node's online CPUs (the loop's quota of a tier without cpus), read at the reconcile: a CPU taken offline
    # or brought back is seen within reconcile_interval, not by a read every tick. 0: not read.
    node_cpus: int = 0
    # The report of what was decided and done so far, for metrics and status.
    groups: tuple[GroupReport, ...] = ()
    tiers: tuple[TierReport, ...] = ()
    slice_supported: bool = False  # custom scheduler slices (sched_runtime, 6.12+), by probing
    # Tiers the loop can still take CPU from (enforce, groups it may set, quota above the floor): admission holds
    # its latency cuts of a tier while it is here, so CPU goes before requests.
    cpu_held: frozenset[str] = frozenset()
    pressed: str = ""  # the tier near its SLO the loop acts for ("" when none)
    counters: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


@dataclass
class Memory:
    """What resources remembers between reconciles: the decisions (policy) read it, their apply (applier) and the
    report (reading) write and read it."""

    groups: dict[str, Group] = field(default_factory=dict)  # the groups as last found
    decided: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # group key -> the values decided
    reports: dict[str, GroupReport] = field(default_factory=dict)
    states: dict[str, str] = field(default_factory=dict)  # group key -> the state last reported
    backed_off: set[str] = field(default_factory=set)
    hinted: dict[int, tuple[str, Hint]] = field(default_factory=dict)  # pid -> (tier, hint) given
    # group key -> the kernel's read-back (cpu.stat, memory events), read on reconcile ticks and shown in between
    readback: dict[str, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)


# What resources counts (actions, writes, moves, threads, errors, rewritten), by kind: the part's `counters`.
Counters = dict[str, collections.Counter[str]]

RESOURCES = PartKey("resources", ResourcesPart)
