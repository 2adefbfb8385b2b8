"""Tier resources: the CPU and memory each tier's serving processes get through their cgroups, scheduler hints for
their threads, and the loop that takes CPU from lower tiers while a higher one nears its SLO.

Every reconcile_interval: find the serving processes and their cgroups (collect), work out each group's files and
each process's hint (decide), write them, originals first (apply). Every tick: the loop's step on this tick's SLO
verdict (policy.decide), whose cuts become the lower tiers' cpu.max. Originals are on disk under state_dir and go
back on stop, at the next start after a crash, or by `qosagent detach`.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Container, Iterable

from qosagent import netns
from qosagent.capability import AgentContext, Capability, CapabilityError, Change, State, Verdict
from qosagent.retention import EVERYONE
from qosagent.cgroups import V2, HostCgroups, cgroup_dir, flat_keyed
from qosagent.cpulist import parse_cpulist
from qosagent.latency.model import LATENCY
from qosagent.pods.service import Pods
from qosagent.resources import applier, discovery, export, planner, policy, sched
from qosagent.resources.model import (BACKED_OFF, CONFLICT, KUBELET, MOVED, OK, RESOURCES, SHARED, BackOff, Files,
                                      Group, GroupReport, Hint, Move, Release, ResourcesPart, Sched, TierReport)
from qosagent.schedule import Every
from qosagent.snapshot import Decision, Snapshot
from qosagent.statefile import StateFileError
from qosagent.units import format_size

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features


@dataclass(frozen=True)
class Plan:
    layout: discovery.Layout
    slices: sched.SliceProbe


def online_cpus(ctx: AgentContext) -> int:
    try:
        return len(parse_cpulist(ctx.hostfs.try_read("/sys/devices/system/cpu/online") or ""))
    except ValueError:
        return 0


def mem_total(ctx: AgentContext) -> int:
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
        for key, v in (("memory", r.memory), ("memory_high", r.memory_high)):
            if v is not None and memory and v > memory:
                out.append(f"tiers.{name}.resources.{key} {format_size(v)} is more than the node's memory "
                           f"({memory / (1 << 30):.1f}GiB)")
    return out


class Resources(Capability):
    name = "resources"
    uses = (netns.Follower, Pods)

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.config: "Config" = ctx.config  # the config in force here (a reload's commit sets it)
        self.store = applier.Store(ctx.config.state_dir)
        self.counters: dict[str, collections.Counter[str]] = {
            k: collections.Counter() for k in ("actions", "writes", "moves", "threads", "errors", "rewritten")}
        self.applier = applier.Applier(ctx.hostfs, self.store, self.counters)
        self.cgroups = HostCgroups(ctx.hostfs)
        self.plan = Plan(discovery.Layout({}), sched.SliceProbe(False, 0))
        self.loop = policy.LoopState()
        self.outcome = policy.Outcome(self.loop, (), frozenset(), "")
        self.groups: dict[str, Group] = {}  # the groups as last found
        self.decided: dict[str, tuple[tuple[str, str], ...]] = {}  # group key -> the values last decided
        self.reports: dict[str, GroupReport] = {}
        self.states: dict[str, str] = {}  # group key -> the state last reported
        self.backed_off: set[str] = set()
        self.hinted: dict[int, tuple[str, Hint]] = {}  # pid -> (tier, hint) given
        self.usage: dict[str, float] = {}
        self._cpu_time: dict[str, tuple[float, int, frozenset[int]]] = {}  # tier -> (when, ticks, pids)
        self._reconcile = Every(ctx.config.resources.reconcile_interval)
        self._reconciling = False

    @property
    def cfg(self) -> Any:
        return self.config.resources

    @property
    def enforce(self) -> bool:
        return self.cfg.mode == "enforce"

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def probe(self, features: "Features") -> Verdict:
        cfg = self.config
        layout = discovery.Layout.probe(self.ctx.hostfs)
        slices = sched.probe_slice(round(self.cfg.latency_slice * 1e9))
        plan = Plan(layout, slices)
        where = ", ".join(f"{c} {v or 'not mounted'}" for c, v in layout.versions.items())
        if not layout.kinds():
            return Verdict(State.UNAVAILABLE, "neither the cpu nor the memory controller is mounted (cgroup v2 or "
                           "v1)", plan)
        problems = [f"the {c} controller is not mounted: its settings are left" for c, v in
                    layout.versions.items() if v is None]
        if not any(t.resources is not None for t in cfg.tiers.values()):
            problems.append("no tier has resources: nothing to set")
        problems += node_problems(cfg, online_cpus(self.ctx), mem_total(self.ctx))
        if self.enforce and os.geteuid() != 0:
            problems.append("not root: cgroup files and other users' threads cannot be written")
        hints = "custom scheduler slices" if slices.supported else "nice (no custom scheduler slices here)"
        return Verdict(State.DEGRADED if problems else State.ACTIVE, "; ".join(problems + [where, hints]), plan)

    def start(self, plan: Plan | None = None) -> None:
        self.plan = plan if plan is not None else self.probe(None)  # type: ignore[arg-type]
        for line in node_problems(self.config, online_cpus(self.ctx), mem_total(self.ctx)):
            self.log.warning("%s", line)
        try:
            self.store.load()
        except StateFileError as e:
            raise CapabilityError(f"{e}; move it away (or run `qosagent detach`) before starting resources") from None
        if not self.store.empty():
            # A crashed agent's writes: the originals it saved go back before anything is set again.
            for line in applier.restore_all(self.ctx.hostfs, self.store):
                self.log.info("%s", line.removeprefix("resources: "))
        self.store.default_slice = self.plan.slices.default_ns

    def stop(self) -> None:
        if not self.cfg.restore_on_stop:
            if not self.store.empty():
                self.log.info("restore_on_stop off: settings stay; `qosagent detach` restores them")
            return
        self._undo()

    def _undo(self) -> None:
        for line in applier.restore_all(self.ctx.hostfs, self.store):
            self.log.info("%s", line.removeprefix("resources: "))
        self.applier.written.clear()
        self.decided, self.reports, self.hinted, self.states = {}, {}, {}, {}
        self.loop = policy.LoopState()

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        store = applier.Store(ctx.config.state_dir)
        try:
            store.load()
        except StateFileError as e:
            return [f"resources: {e}; kept, restore the values it names by hand and remove it"]
        return applier.restore_all(ctx.hostfs, store) if not store.empty() else []

    def prepare(self, config: "Config") -> Change:
        old = self.config

        def commit() -> None:
            was_enforcing = self.enforce
            self.config = config
            self._reconcile.period = self.cfg.reconcile_interval
            if was_enforcing and not self.enforce:
                self._undo()  # a dry run must not leave earlier writes behind as if still decided
            self.decided = {}
            self._reconcile.again()

        def undo() -> None:
            self.config = old
            self._reconcile.period = self.cfg.reconcile_interval
            self.decided = {}
            self._reconcile.again()

        return Change(commit, undo)

    # ---- one tick ----------------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Whether this tick reconciles; if so, threads born since in the hinted processes get their hint."""
        self._reconciling = self._reconcile.due(self.ctx.clock())
        if self._reconciling and self.enforce:
            for pid, (_, hint) in sorted(self.hinted.items()):
                self.applier.hint([pid], hint)

    def collect(self) -> ResourcesPart:
        found: tuple[Group, ...] = ()
        serving: tuple[Any, ...] = ()
        rewritten: dict[str, tuple[str, ...]] = {}
        if self._reconciling:
            cfg = self.config
            rules = netns.ns_rules(cfg.tenants)
            pods = self.ctx.service(Pods)
            pods.current(any(r.by_pod for r in rules), cfg.pods)
            namespaces = self.ctx.service(netns.Follower).current(
                cfg.tracked_ports(), any(not r.by_pod for r in rules), self.ctx.clock())
            serving = tuple(discovery.serving(self.ctx.hostfs, cfg, namespaces, pods.pod_of, os.getpid()))
            found = tuple(discovery.groups(self.ctx.hostfs, self.cgroups, self.plan.layout, serving,
                                           self.cfg.kubelet_cgroups == "report", os.getpid()))
            for g in found:
                paths = self.applier.rewritten(g.directory)
                if paths:
                    rewritten[g.key] = tuple(paths)
            self._measure(serving)
        return ResourcesPart(mode=self.cfg.mode, enforcing=self.enforce, reconcile=self._reconciling, found=found,
                             serving=serving, rewritten=rewritten, usage=dict(self.usage))

    def _measure(self, serving: Iterable[Any]) -> None:
        """CPUs each tier's serving processes used since the last reconcile (utime + stime of every thread)."""
        now = self.ctx.clock()
        hz = os.sysconf("SC_CLK_TCK")
        pids: dict[str, set[int]] = collections.defaultdict(set)
        for p in serving:
            pids[p.tier].add(p.pid)
        for tier, ps in pids.items():
            ticks = 0
            for pid in ps:
                stat = self.ctx.hostfs.try_read(f"/proc/{pid}/stat")
                if stat:
                    f = stat.rsplit(")", 1)[-1].split()
                    ticks += int(f[11]) + int(f[12])
            prev = self._cpu_time.get(tier)
            if prev is not None and prev[2] == frozenset(ps) and now > prev[0]:
                self.usage[tier] = round((ticks - prev[1]) / hz / (now - prev[0]), 3)
            self._cpu_time[tier] = (now, ticks, frozenset(ps))
        for gone in set(self.usage) - set(pids):
            del self.usage[gone]

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        part = snapshot.part(RESOURCES)
        if part is None:
            return []
        out: list[Decision] = []
        before = dict(self.loop.quota)
        out += self._step(snapshot, part)
        quota_changed = {t for t in set(before) | set(self.loop.quota) if before.get(t) != self.loop.quota.get(t)}
        if part.reconcile:
            out += self._reconcile_groups(part)
            out += self._hints(part)
        elif quota_changed:
            out += self._files([g for g in self.groups.values() if g.tier in quota_changed])
        return out

    def _step(self, snapshot: Snapshot, part: ResourcesPart) -> list[Decision]:
        cfg = self.config
        lat = snapshot.part(LATENCY)
        if lat is None:
            return []
        adm = cfg.admission
        tier_slo = {t.tier: cfg.tiers[t.tier].slo_p99 for t in cfg.tenants}
        verdict = lat.judged(adm.signal, adm.quantile, tier_slo, adm.near_slo, adm.healthy_below)
        settable = {g.tier for g in self.groups.values() if self._settable(g)}
        tiers = {name: policy.TierIn(name, cfg.tiers[name].weight, v,
                                     (cfg.tiers[name].resources.cpus if cfg.tiers[name].resources else None),
                                     name in settable and cfg.tiers[name].resources is not None,
                                     part.usage.get(name))
                 for name, v in verdict.tiers.items()}
        self.outcome = policy.decide(tiers, self.cfg.suppress, float(online_cpus(self.ctx) or 1),
                                     snapshot.monotonic, self.loop)
        self.loop = self.outcome.state
        return [self._decision(f"tier {s.tier}", s.action, _cpus(s.old), _cpus(s.new), s.reason,
                               {"tier": s.tier, "why": s.why, **s.inputs}, None)
                for s in self.outcome.steps]

    def _settable(self, g: Group) -> bool:
        return g.state in (OK, MOVED) and g.key not in self.backed_off

    def _reconcile_groups(self, part: ResourcesPart) -> list[Decision]:
        out: list[Decision] = []
        now = {g.key: g for g in part.found}
        for key, g in sorted(self.groups.items()):
            if key not in now and key in self.decided:
                out.append(self._decision(key, "release", _shown(self.decided[key]), None,
                                          "its serving processes left the cgroup", {"tier": g.tier}, Release(g)))
        for key, paths in sorted(part.rewritten.items()):
            if key not in self.backed_off:
                g = now[key]
                out.append(self._decision(key, "back_off", None, None, "rewritten by another owner: left to it",
                                          {"tier": g.tier, "files": [os.path.basename(p) for p in paths]},
                                          BackOff(g, paths)))
        self.groups = now
        for key, g in sorted(now.items()):
            state = BACKED_OFF if key in self.backed_off or key in part.rewritten else g.state
            if state in (SHARED, CONFLICT) and self.cfg.move:
                if self.states.get(key) != MOVED:
                    by_tier = tuple((t, tuple(sorted({p.pid for p in part.serving if p.tier == t and p.pid in g.pids})))
                                    for t in g.tiers)
                    out.append(self._decision(key, "move", g.path, ", ".join(discovery.own_cgroup(t) for t in g.tiers),
                                              g.why, {"tiers": list(g.tiers), "pids": list(g.pids)}, Move(g, by_tier)))
                    self.states[key] = MOVED
                continue
            if state != OK and not (state == KUBELET and self.cfg.kubelet_cgroups == "enforce"):
                if self.states.get(key) != state:
                    out.append(self._decision(key, "report", None, None, f"{state}: {g.why or 'left to its owner'}",
                                              {"tiers": list(g.tiers), "pids": list(g.pids)}, None, applied=True))
                    self.states[key] = state
                continue
            self.states[key] = state
        self.states = {k: v for k, v in self.states.items() if k in now}
        out += self._files([g for g in now.values() if self.states.get(g.key) in (OK, KUBELET)])
        return out

    def _files(self, groups: list[Group]) -> list[Decision]:
        out = []
        cfg = self.config
        for g in sorted(groups, key=lambda g: g.key):
            if not g.tier or g.key in self.backed_off:
                continue
            tier = cfg.tiers.get(g.tier)
            if tier is None:
                continue
            has_idle = self.ctx.hostfs.exists(f"{g.directory}/cpu.idle")
            values = planner.values(g.controller, g.version, tier, self.loop.quota.get(g.tier), has_idle)
            if values == self.decided.get(g.key, ()):
                continue  # unchanged, or nothing to set and nothing set before
            cut = self.loop.quota.get(g.tier)
            reason = (f"{g.tier}: suppressed to {cut:g} CPUs" if cut is not None and g.controller == "cpu"
                      else f"{g.tier}: tiers.{g.tier}.resources")
            out.append(self._decision(g.key, "set" if values else "release", _shown(self.decided.get(g.key)),
                                      _shown(values), reason, {"tier": g.tier, "version": g.version,
                                                              "pids": list(g.pids)},
                                      Files(g, values) if values else Release(g)))
        return out

    def _hint_of(self, tier: str) -> Hint | None:
        t = self.config.tiers.get(tier)
        if t is None or t.resources is None:
            return None
        if t.resources.sched != "normal":
            return Hint(t.resources.sched)
        if not t.latency_sensitive():
            return None
        if self.plan.slices.supported:
            return Hint("normal", slice_ns=round(self.cfg.latency_slice * 1e9))
        return Hint("normal", nice=self.cfg.latency_nice)

    def _hints(self, part: ResourcesPart) -> list[Decision]:
        out = []
        by_pid: dict[int, Any] = {}
        for p in part.serving:
            by_pid.setdefault(p.pid, p)
        for pid, p in sorted(by_pid.items()):
            hint = self._hint_of(p.tier)
            tiers = {q.tier for q in part.serving if q.pid == pid}
            if hint is None or len(tiers) > 1 or self.hinted.get(pid) == (p.tier, hint):
                continue
            out.append(self._decision(f"pid {pid} ({p.name})", "hint", None, hint.shown(),
                                      f"{p.tier}: " + ("latency-sensitive" if hint.policy == "normal"
                                                       else f"sched {hint.policy}"),
                                      {"tier": p.tier, "pid": pid}, Sched(p.tier, (pid,), hint)))
        for pid, (tier, hint) in sorted(self.hinted.items()):
            if pid not in by_pid or self._hint_of(by_pid[pid].tier) is None:
                out.append(self._decision(f"pid {pid}", "unhint", hint.shown(), None, "no longer a serving process "
                                          "with a hint", {"tier": tier, "pid": pid}, Sched(tier, (pid,), None)))
        return out

    def _decision(self, target: str, action: str, old: Any, new: Any, reason: str, inputs: dict[str, Any],
                  command: Any, applied: bool | None = None) -> Decision:
        return Decision(self.name, target, action, old, new, reason, inputs,
                        applied=self.enforce if applied is None else applied, command=command)

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if d.capability != self.name:
                continue
            self.counters["actions"][d.action] += 1
            c = d.command
            if isinstance(c, Files):
                self._apply_files(c)
            elif isinstance(c, Release):
                self.decided.pop(c.group.key, None)
                self.reports.pop(c.group.key, None)
                if self.enforce:
                    self.applier.release(c.group.directory)
            elif isinstance(c, Move):
                self._apply_move(c)
            elif isinstance(c, BackOff):
                self.backed_off.add(c.group.key)
                self.counters["rewritten"][c.group.controller] += 1
                self.log.warning("%s: %s rewritten by another owner (the kubelet, systemd): left to it", c.group.key,
                                 ", ".join(os.path.basename(p) for p in c.paths))
                self.applier.let_go(c.paths)
            elif isinstance(c, Sched):
                self._apply_sched(c)

    def _apply_files(self, c: Files) -> None:
        g = c.group
        self.decided[g.key] = c.values
        if not self.enforce:
            self.reports[g.key] = GroupReport(g, dict(c.values), applied=False)
            return
        try:
            self.applier.files(c)
            self.reports[g.key] = GroupReport(g, dict(c.values), applied=True)
        except applier.Refused as e:
            self.reports[g.key] = GroupReport(g, dict(c.values), applied=False, error=str(e))
            # Tried again at the next reconcile, not every tick: a refusal is the kernel's answer for a while.
            self.decided.pop(g.key, None)
            self.log.warning("%s: not set, what was written of it is back: %s", g.key, e)

    def _apply_move(self, c: Move) -> None:
        g = c.group
        if not self.enforce:
            return
        try:
            for tier, pids in c.by_tier:
                into = cgroup_dir(self.ctx.hostfs, g.version, g.controller, discovery.own_cgroup(tier))
                if into is None:
                    raise OSError(2, f"the {g.controller} hierarchy is not mounted")
                self.applier.move(g, pids, into)
        except (applier.Refused, OSError) as e:
            self.states.pop(g.key, None)  # tried again at the next reconcile
            self.log.warning("%s: moving its serving processes failed: %s", g.key, e)

    def _apply_sched(self, c: Sched) -> None:
        if c.hint is None:
            for pid in c.pids:
                self.hinted.pop(pid, None)
            if self.enforce:
                self.applier.unhint(c.pids)
            return
        for pid in c.pids:
            self.hinted[pid] = (c.tier, c.hint)
        if self.enforce:
            self.applier.hint(c.pids, c.hint)

    def settled(self, part: ResourcesPart) -> ResourcesPart:
        return self._report(part)

    # ---- reporting ---------------------------------------------------------------------------------------
    def _report(self, part: ResourcesPart) -> ResourcesPart:
        cfg = self.config
        groups = []
        for key, g in sorted(self.groups.items()):
            r = self.reports.get(key, GroupReport(g))
            state = self.states.get(key, g.state)
            groups.append(GroupReport(
                Group(g.controller, g.version, g.path, g.directory, g.tiers, g.pids,
                      BACKED_OFF if key in self.backed_off else state, g.why, g.others),
                r.set, r.applied, r.error, *self._kernel(g)))
        threads: collections.Counter[str] = collections.Counter()
        for t in self.store.threads.values():
            hinted = self.hinted.get(t.pid)
            if hinted is not None:
                threads[hinted[0]] += 1
        tiers = []
        for name, t in sorted(cfg.tiers.items()):
            if t.resources is None:
                continue
            hint = self._hint_of(name)
            tiers.append(TierReport(name, sum(1 for g in self.groups.values() if g.tier == name),
                                    self.loop.quota.get(name), t.resources.cpus, self.loop.steps.get(name, 0),
                                    hint.shown() if hint else "", threads[name], part.usage.get(name)))
        held = self.outcome.held if self.enforce else frozenset()
        return replace(part, groups=tuple(groups), tiers=tuple(tiers), slice_supported=self.plan.slices.supported,
                       cpu_held=held, pressed=self.outcome.pressed,
                       counters={k: dict(v) for k, v in self.counters.items()})

    def _kernel(self, g: Group) -> tuple[dict[str, int], dict[str, int]]:
        """What the kernel reports back: CPU throttling (cpu.stat) and memory events."""
        fs = self.ctx.hostfs
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

    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(RESOURCES)
        return export.metrics(part) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(RESOURCES)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)


def _cpus(v: float | None) -> str | None:
    return None if v is None else f"{v:g}"


def _shown(values: tuple[tuple[str, str], ...] | None) -> str | None:
    return None if not values else ", ".join(f"{f}={v}" for f, v in values)
