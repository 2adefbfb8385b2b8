"""What resources reads back from the host: the node's CPUs and memory (and what the tiers ask beyond them), the CPU
each tier's serving processes used, and what the kernel reports of each group (throttling, memory events); with
what was decided and done, the report that status and metrics show."""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from qosagent.cgroups import V2, flat_keyed
from qosagent.cpulist import parse_cpulist
from qosagent.hostfs import HostFS
from qosagent.resources import policy
from qosagent.resources.model import BACKED_OFF, Counters, Group, GroupReport, Memory, ResourcesPart, TierReport
from qosagent.units import approx_size, format_size

if TYPE_CHECKING:
    from qosagent.capability import AgentContext
    from qosagent.config import Config


def online_cpus(ctx: "AgentContext") -> int:
    try:
        return len(parse_cpulist(ctx.hostfs.try_read("/sys/devices/system/cpu/online") or ""))
    except ValueError:
        return 0


def mem_total(ctx: "AgentContext") -> int:
    for line in (ctx.hostfs.try_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def node_problems(cfg: "Config", cpus: int, memory: int) -> list[str]:
    """What the tiers ask that this node cannot give (`qosagent check` says it; the agent logs it and goes on)."""
    out = []
    for name, t in sorted(cfg.tiers.items()):
        r = t.resources
        if r is None:
            continue
        if r.cpus is not None and cpus and r.cpus > cpus:
            out.append(f"tiers.{name}.resources.cpus {r.cpus:g} is more than the node's {cpus} online CPUs")
        for key, v in (("memory", r.memory), ("memory_high", r.memory_high), ("memory_max", r.memory_max)):
            if isinstance(v, int) and memory and v > memory:
                out.append(f"tiers.{name}.resources.{key} {format_size(v)} is more than the node's memory "
                           f"({memory / (1 << 30):.1f}GiB)")
    # Each serving cgroup of a tier with tenants holds its guarantee: promised beyond the node, the kernel shares
    # what there is out in proportion (v2 memory.min), and no tier gets what it was promised.
    promised = {n: r.memory for n in sorted({t.tier for t in cfg.tenants})
                if (r := cfg.tiers[n].resources) is not None and r.memory is not None}
    if memory and len(promised) > 1 and sum(promised.values()) > memory:
        out.append(f"the memory guarantees of tiers {', '.join(promised)} add up to "
                   f"{format_size(sum(promised.values()))} (one serving cgroup each), more than the node's memory "
                   f"({memory / (1 << 30):.1f}GiB)")
    return out


# Where a memory group's use is read: what the kernel charges to the cgroup, page cache included, as the limits
# below count it.
USAGE = {V2: "memory.current", "v1": "memory.usage_in_bytes"}
# The memory files resources writes that a group's use can already be above, and what the kernel does then.
LIMITS = {
    "memory.high": "throttled from the first write (the kernel reclaims its pages and slows its allocations)",
    "memory.max": "reclaimed at the write, its processes OOM-killed if that is not enough",
    # v1's soft limit throttles nothing: it only says whose pages go first when the node runs short.
    "memory.soft_limit_in_bytes": "reclaimed first when the node runs short of memory (no throttle, no kill)",
    "memory.limit_in_bytes": "the write is refused (EBUSY) unless reclaim brings it under: none of its files set",
}
# v1 writes no limit as the largest page count (9223372036854771712 on 4 KiB pages): shown as max, as v2 writes it.
V1_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Above:
    """A limit resources would write on a memory group that its use is already above."""

    file: str
    limit: int  # bytes
    now: str  # what the file holds before the write, as shown ("max", a size, or why it cannot be read)

    @property
    def effect(self) -> str:
        return LIMITS[self.file]


@dataclass(frozen=True)
class MemoryCheck:
    """A memory group's use against the limits it would get: those it is above, or why its use cannot be told."""

    group: Group
    usage_file: str
    usage: int | None  # bytes; None: unreadable (why says so)
    above: tuple[Above, ...] = ()
    why: str = ""

    def line(self, gets: str = "would get", mode: str = "enforce") -> str:
        """One line for the operator; `gets`: "would get" (`qosagent check`) or "gets" (the agent, at the write);
        `mode`: resources.mode, under dry-run nothing is written, so the limits are those enforce would write."""
        if mode == "dry-run":
            gets = f"{gets} (in enforce)"
        g = self.group
        head = f"tier {g.tier}: {g.directory} (memory {g.version})"
        if self.usage is None:
            return f"{head}: cannot tell whether it is above the limits it {gets}: {self.why}"
        limits = "; ".join(
            f"above the {a.file} {approx_size(a.limit)} it {gets} by {approx_size(self.usage - a.limit)} "
            f"(now {a.now}): {a.effect}" for a in self.above)
        return f"{head}: {self.usage_file} {approx_size(self.usage)}, {limits}"

    def as_dict(self, mode: str = "enforce") -> dict[str, Any]:
        g = self.group
        return {"tier": g.tier, "cgroup": g.path, "directory": g.directory, "version": g.version, "mode": mode,
                "usage_file": self.usage_file, "usage_bytes": self.usage, "error": self.why or None,
                "above": [{"file": a.file, "limit_bytes": a.limit, "now": a.now, "effect": a.effect}
                          for a in self.above]}


def _bytes(text: str) -> int | None:
    """A byte count as the kernel writes one (ASCII digits alone), else None: str.isdigit() takes "²" too."""
    v = text.strip()
    return int(v) if v.isascii() and v.isdigit() else None


def _shown(text: str | None) -> str:
    """A memory limit file's value as shown: max, a size, or what is wrong with it."""
    if text is None:
        return "unreadable"
    n = _bytes(text)
    if text.strip() == "max" or (n is not None and n >= V1_NO_LIMIT):
        return "max"
    return approx_size(n) if n is not None else f"{ascii(text.strip()[:24])}, not a size"


def memory_check(fs: HostFS, g: Group, values: Mapping[str, str]) -> MemoryCheck | None:
    """A memory group's use against the limits among `values` (file -> what would be written, planner.values):
    None when it is below them all, or when none of them is a limit (max, or no limit file at all)."""
    limits = {f: n for f, v in values.items() if f in LIMITS and (n := _bytes(v)) is not None}
    if g.controller != "memory" or not limits:
        return None
    usage_file = USAGE[V2 if g.version == V2 else "v1"]
    text = fs.try_read(f"{g.directory}/{usage_file}")
    usage = _bytes(text) if text is not None else None
    if usage is None:
        why = (f"{usage_file} cannot be read" if text is None
               else f"{usage_file} reads {ascii(text.strip()[:24])}, not a byte count")
        return MemoryCheck(g, usage_file, None, why=why)
    above = tuple(Above(f, limit, _shown(fs.try_read(f"{g.directory}/{f}")))
                  for f, limit in limits.items() if usage > limit)
    return MemoryCheck(g, usage_file, usage, above) if above else None


class CpuUsage:
    """CPUs each tier's serving processes used since the last reconcile (utime + stime of every thread)."""

    def __init__(self) -> None:
        self.usage: dict[str, float] = {}
        self._cpu_time: dict[str, tuple[float, int, frozenset[int]]] = {}  # tier -> (when, ticks, pids)

    def measure(self, fs: HostFS, now: float, serving: Iterable[Any]) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        pids: dict[str, set[int]] = collections.defaultdict(set)
        for p in serving:
            pids[p.tier].add(p.pid)
        for tier, ps in pids.items():
            ticks = 0
            for pid in ps:
                stat = fs.try_read(f"/proc/{pid}/stat")
                if stat:
                    f = stat.rsplit(")", 1)[-1].split()
                    ticks += int(f[11]) + int(f[12])
            prev = self._cpu_time.get(tier)
            if prev is not None and prev[2] == frozenset(ps) and now > prev[0]:
                self.usage[tier] = round((ticks - prev[1]) / hz / (now - prev[0]), 3)
            self._cpu_time[tier] = (now, ticks, frozenset(ps))
        for gone in set(self.usage) - set(pids):
            del self.usage[gone]


def kernel(fs: HostFS, g: Group) -> tuple[dict[str, int], dict[str, int]]:
    """What the kernel reports back: CPU throttling (cpu.stat) and memory events."""
    if g.controller == "cpu":
        stat = flat_keyed(fs.try_read(f"{g.directory}/cpu.stat"))
        if g.version != V2 and "throttled_time" in stat:
            stat["throttled_usec"] = stat.pop("throttled_time") // 1000
        return {k: stat[k] for k in ("nr_periods", "nr_throttled", "throttled_usec") if k in stat}, {}
    if g.version == V2:
        return {}, flat_keyed(fs.try_read(f"{g.directory}/memory.events"))
    events = {}
    failcnt = fs.try_read(f"{g.directory}/memory.failcnt")
    if failcnt is not None and failcnt.strip().isdigit():
        events["failcnt"] = int(failcnt)
    oom = flat_keyed(fs.try_read(f"{g.directory}/memory.oom_control"))
    if "oom_kill" in oom:
        events["oom_kill"] = oom["oom_kill"]
    return {}, events


def report(fs: HostFS, rules: policy.Rules, mem: Memory, thread_pids: Iterable[int], loop: policy.LoopState,
           outcome: policy.Outcome, counters: Counters, part: ResourcesPart) -> ResourcesPart:
    """The part as status and metrics show it: each group with what was set and the kernel's read-back, each tier
    with its suppression, hint and threads."""
    groups = []
    # The read-back follows the reconcile's cadence, not the tick's: these counters only move at the kernel's CFS
    # period and memory events, and every tick would read each group's files twenty times as often.
    readback = {key: kernel(fs, g) if part.reconcile or key not in mem.readback else mem.readback[key]
                for key, g in mem.groups.items()}
    mem.readback = readback
    for key, g in sorted(mem.groups.items()):
        r = mem.reports.get(key, GroupReport(g))
        state = mem.states.get(key, g.state)
        groups.append(GroupReport(
            Group(g.controller, g.version, g.path, g.directory, g.tiers, g.pids,
                  BACKED_OFF if key in mem.backed_off else state, g.why, g.others),
            r.set, r.applied, r.error, *readback[key]))
    hinted: collections.Counter[str] = collections.Counter()
    for pid in thread_pids:
        given = mem.hinted.get(pid)
        if given is not None:
            hinted[given[0]] += 1
    tiers = []
    for name, t in sorted(rules.config.tiers.items()):
        if t.resources is None:
            continue
        hint = policy.hint_of(rules.config, rules.slices, name)
        tiers.append(TierReport(name, sum(1 for g in mem.groups.values() if g.tier == name),
                                loop.quota.get(name), t.resources.cpus, loop.steps.get(name, 0),
                                hint.shown() if hint else "", hinted[name], part.usage.get(name)))
    held = outcome.held if rules.enforce else frozenset()
    return replace(part, groups=tuple(groups), tiers=tuple(tiers), slice_supported=rules.slices,
                   cpu_held=held, pressed=outcome.pressed, counters={k: dict(v) for k, v in counters.items()})
