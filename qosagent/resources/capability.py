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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Container, Iterable

from qosagent import netns
from qosagent.capability import AgentContext, Capability, CapabilityError, Change, Finding, State, Verdict
from qosagent.retention import EVERYONE
from qosagent import sandbox
from qosagent.sandbox import Need
from qosagent.cgroups import HostCgroups, hierarchy
from qosagent.hostfs import HostFS
from qosagent.latency.model import LATENCY
from qosagent.pods.service import Pods
from qosagent.resources import applier, discovery, export, planner, policy, sched
from qosagent.resources.model import OK, RESOURCES, Group, Memory, ResourcesPart, Serving
from qosagent.resources.reading import CpuUsage, mem_total, memory_check, node_problems, online_cpus, report
from qosagent.schedule import Every
from qosagent.slo import tier_slos
from qosagent.snapshot import Decision, Snapshot
from qosagent.statefile import StateFileError

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features


def cgroup_mounts(fs: HostFS) -> list[str]:
    """The hierarchies resources writes on this host: the v2 root, or each v1 controller's (hybrid and legacy hosts,
    where /sys/fs/cgroup itself is a tmpfs systemd mounts read-only)."""
    kinds = dict.fromkeys(discovery.Layout.probe(fs).kinds().values())
    return [root for kind in kinds if (root := hierarchy(fs, kind)) is not None]


@dataclass(frozen=True)
class Plan:
    layout: discovery.Layout
    slices: sched.SliceProbe


class Resources(Capability):
    name = "resources"
    uses = (netns.Follower, Pods)

    @classmethod
    def sandbox_needs(cls, config: "Config") -> list[Need]:
        # Discovery reads in every mode: dry-run reports what it would write to whom.
        reads = sandbox.other_processes("find the serving processes by their sockets (/proc/PID/fd) and the pods' "
                                        "network namespaces (/proc/PID/ns/net)", fds=True)
        if config.resources.mode != "enforce":
            return reads
        return reads + [
            Need("CapabilityBoundingSet", "CAP_SYS_NICE", "set other users' threads' scheduling (policy, nice, slice)"),
            # Both: ReadOnlyPaths=/sys covers the cgroup tree, and ProtectControlGroups=yes keeps it read-only even
            # under ReadWritePaths=/sys/fs/cgroup (systemd keeps the stricter of two entries for one path).
            Need("ReadWritePaths", sandbox.CGROUP_FS, "write the serving cgroups' cpu and memory files", host=True,
                 within=cgroup_mounts),
            Need("ProtectControlGroups", "no", "write the serving cgroups' cpu and memory files"),
        ] + sandbox.state_dir(config)

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.config: "Config" = ctx.config  # the config in force here (a reload's commit sets it)
        self._tier_slo = tier_slos(ctx.config)  # the loop's SLO of each tier, per config
        self.store = applier.Store(ctx.config.state_dir)
        self.counters: dict[str, collections.Counter[str]] = {
            k: collections.Counter() for k in ("actions", "writes", "moves", "threads", "errors", "rewritten")}
        self.applier = applier.Applier(ctx.hostfs, self.store, self.counters)
        self.cgroups = HostCgroups(ctx.hostfs)
        self.plan = Plan(discovery.Layout({}), sched.SliceProbe(False, 0))
        self.loop = policy.LoopState()
        self.outcome = policy.Outcome(self.loop, (), frozenset(), "")
        self.memory = Memory()
        self.cpu = CpuUsage()
        self._reconcile = Every(ctx.config.resources.reconcile_interval)
        self._node_cpus = online_cpus(ctx)
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
        problems += planner.left_out(cfg, layout.versions.get("memory"))
        if self.enforce and os.geteuid() != 0:
            problems.append("not root: cgroup files and other users' threads cannot be written")
        hints = "custom scheduler slices" if slices.supported else "nice (no custom scheduler slices here)"
        return Verdict(State.DEGRADED if problems else State.ACTIVE, "; ".join(problems + [where, hints]), plan)

    def start(self, plan: Plan | None = None) -> None:
        self.plan = plan if plan is not None else self.probe(None).plan  # type: ignore[arg-type]
        for line in node_problems(self.config, online_cpus(self.ctx), mem_total(self.ctx)):
            self.log.warning("%s", line)
        self._say_left_out(self.config)
        try:
            self.store.load()
        except StateFileError as e:
            raise CapabilityError(f"{e}; move it away (or run `qosagent detach`) before starting resources") from None
        if not self.store.empty():
            # A crashed agent's writes: the originals it saved go back before anything is set again.
            for line in applier.restore_all(self.ctx.hostfs, self.store):
                self.log.info("%s", line.removeprefix("resources: "))
        self.store.default_slice = self.plan.slices.default_ns

    def _say_left_out(self, config: "Config", before: "Config | None" = None) -> None:
        """What this host's memory controller cannot set of a config, said once: at start, and on a reload only what
        the config before it did not ask already."""
        version = self.plan.layout.versions.get("memory")
        said = planner.left_out(before, version) if before is not None else []
        for line in planner.left_out(config, version):
            if line not in said:
                self.log.warning("%s", line)

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
        m = self.memory
        m.decided, m.reports, m.hinted, m.states = {}, {}, {}, {}
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
            self.config, self._tier_slo = config, tier_slos(config)
            self._reconcile.period = self.cfg.reconcile_interval
            self._say_left_out(config, old)
            if was_enforcing and not self.enforce:
                self._undo()  # a dry run must not leave earlier writes behind as if still decided
            self.memory.decided = {}
            self._reconcile.again()

        def undo() -> None:
            self.config, self._tier_slo = old, tier_slos(old)
            self._reconcile.period = self.cfg.reconcile_interval
            self.memory.decided = {}
            self._reconcile.again()

        return Change(commit, undo)

    # ---- one tick ----------------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Whether this tick reconciles; if so, threads born since in the hinted processes get their hint."""
        self._reconciling = self._reconcile.due(self.ctx.clock())
        if self._reconciling and self.enforce:
            for pid, (_, hint) in sorted(self.memory.hinted.items()):
                self.applier.hint([pid], hint)

    def _discover(self, layout: discovery.Layout, starting: bool = False) -> tuple[list[Serving], list[Group]]:
        """The serving processes and their groups, as each reconcile finds them (and `qosagent check`)."""
        cfg = self.config
        rules = netns.ns_rules(cfg.tenants)
        pods = self.ctx.service(Pods)
        pods.current(any(r.by_pod for r in rules), cfg.pods, starting)
        namespaces = self.ctx.service(netns.Follower).current(
            cfg.tracked_ports(), any(not r.by_pod for r in rules), self.ctx.clock())
        serving = discovery.serving(self.ctx.hostfs, cfg, namespaces, pods.pod_of, os.getpid())
        return serving, discovery.groups(self.ctx.hostfs, self.cgroups, layout, serving,
                                         self.cfg.kubelet_cgroups == "report", os.getpid())

    def collect(self) -> ResourcesPart:
        found: tuple[Group, ...] = ()
        serving: tuple[Any, ...] = ()
        rewritten: dict[str, tuple[str, ...]] = {}
        if self._reconciling:
            listed, groups = self._discover(self.plan.layout)
            serving, found = tuple(listed), tuple(groups)
            for g in found:
                paths = self.applier.rewritten(g.directory, g.controller)
                if paths:
                    rewritten[g.key] = tuple(paths)
            self.cpu.measure(self.ctx.hostfs, self.ctx.clock(), serving)
            self._node_cpus = online_cpus(self.ctx)
        return ResourcesPart(mode=self.cfg.mode, enforcing=self.enforce, reconcile=self._reconciling, found=found,
                             serving=serving, rewritten=rewritten, usage=dict(self.cpu.usage),
                             node_cpus=self._node_cpus)

    def findings(self, plan: Plan) -> list[Finding]:
        """The serving groups it would set whose memory use is already above a limit they would get (or cannot be
        read): the agent throttles, reclaims or is refused there from its first write (in enforce: a dry-run writes
        nothing, and its lines say so)."""
        out = []
        for g in self._discover(plan.layout, starting=True)[1]:
            if g.state != OK or g.controller != "memory":
                continue  # shared, conflicting, kubelet-owned and unavailable groups are reported, not set
            values = planner.values("memory", g.version, self.config.tiers[g.tier], None, False)
            found = memory_check(self.ctx.hostfs, g, dict(values))
            if found is not None:
                out.append(Finding(found.line(mode=self.cfg.mode), found.as_dict(self.cfg.mode)))
        return out

    def _rules(self) -> policy.Rules:
        return policy.Rules(self.config, self.enforce, self.plan.slices.supported,
                            lambda directory: self.ctx.hostfs.exists(f"{directory}/cpu.idle"), self._tier_slo)

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        part = snapshot.part(RESOURCES)
        if part is None:
            return []
        rules, mem = self._rules(), self.memory
        out: list[Decision] = []
        before = dict(self.loop.quota)
        lat = snapshot.part(LATENCY)
        if lat is not None:
            self.outcome = policy.step(rules, lat, part, mem, float(part.node_cpus or 1), snapshot.monotonic,
                                       self.loop)
            self.loop = self.outcome.state
            out += policy.step_decisions(rules, self.outcome)
        quota_changed = {t for t in set(before) | set(self.loop.quota) if before.get(t) != self.loop.quota.get(t)}
        if part.reconcile:
            out += policy.reconcile(rules, mem, self.loop.quota, part)
            out += policy.hints(rules, mem, part)
        elif quota_changed:
            changed = [g for g in mem.groups.values() if g.tier in quota_changed]
            out += policy.files(rules, mem, self.loop.quota, changed)
        return out

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if d.capability != self.name:
                continue
            self.counters["actions"][d.action] += 1
            applier.carry_out(self.applier, self.memory, self.enforce, d.command)

    def settled(self, part: ResourcesPart) -> ResourcesPart:
        return report(self.ctx.hostfs, self._rules(), self.memory, [t.pid for t in self.store.threads.values()],
                      self.loop, self.outcome, self.counters, part)

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(RESOURCES)
        return export.metrics(part) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(RESOURCES)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)

