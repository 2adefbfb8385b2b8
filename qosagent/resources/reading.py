"""What resources reads back from the host: the node's CPUs and memory (and what the tiers ask beyond them), the CPU
each tier's serving processes used, and what the kernel reports of each group (throttling, memory events); with
what was decided and done, the report that status and metrics show."""

from __future__ import annotations

import collections
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

from qosagent.cgroups import V2, flat_keyed
from qosagent.cpulist import parse_cpulist
from qosagent.hostfs import HostFS
from qosagent.resources import policy
from qosagent.resources.applier import Counters
from qosagent.resources.model import BACKED_OFF, Group, GroupReport, Memory, ResourcesPart, TierReport
from qosagent.units import format_size

if TYPE_CHECKING:
    from qosagent.capability import AgentContext
    from qosagent.config import Config
    from qosagent.resources.applier import Thread


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


def report(fs: HostFS, rules: policy.Rules, mem: Memory, threads: Iterable["Thread"], loop: policy.LoopState,
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
    for t in threads:
        given = mem.hinted.get(t.pid)
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
