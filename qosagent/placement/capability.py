"""NUMA placement: keep each selected inference process, its threads and its memory on the node of its GPUs.

Every reconcile_interval: discover the selected processes (collect), plan each one's CPUs and memory node and compare
with what its threads have now (decide), pin and migrate, then read the result back (apply). Processes are touched
only when a selector (or, opted in, NVML's compute-process list) names them. Originals are saved before the first
write, on disk under state_dir, and put back on stop (or by `qosagent detach` after a crash).
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Any, Container, Iterable


from qosagent.capability import AgentContext, Capability, CapabilityError, Change, State, Verdict
from qosagent.retention import EVERYONE
from qosagent import sandbox
from qosagent.sandbox import Need
from qosagent.placement import applier, export, policy
from qosagent.placement.config import PlacementConfig
from qosagent.cpulist import parse_cpulist
from qosagent.cgroups import HostCgroups
from qosagent.placement.model import PLACEMENT, Drop, PlacementPart, Place, Record
from qosagent.placement.discovery import Matcher, ProcInfo, discover, numa_pages, proc_start
from qosagent.placement.planner import Policy, plan
from qosagent.placement.topology import Topology, read_topology
from qosagent.schedule import Every
from qosagent.statefile import StateFileError
from qosagent.snapshot import Decision, Snapshot

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config


class Placement(Capability):
    name = "placement"

    @classmethod
    def sandbox_needs(cls, config: "Config") -> list[Need]:
        p = [Need("CapabilityBoundingSet", "CAP_SYS_PTRACE",
                  "read other users' processes' numa_maps, and migrate_pages their memory")]
        if config.placement.mode == "enforce":
            p.append(Need("CapabilityBoundingSet", "CAP_SYS_NICE", "set the CPU affinity of other users' processes"))
        return p + sandbox.state_dir(config)

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.cfg: PlacementConfig = ctx.config.placement
        self.topology: Topology | None = None
        self.store = applier.OriginalsStore(ctx.config.state_dir)
        self.records: dict[int, Record] = {}
        self.counters: dict[str, collections.Counter[str]] = {
            k: collections.Counter() for k in ("actions", "migrations", "pages_migrated", "drift", "errors")
        }
        self._gpu_pids: set[int] = set()  # NVML's compute processes, as of this tick's maintain()
        self._reconcile = Every(self.cfg.reconcile_interval)
        self._reconciling = False  # this tick reconciles: maintain() says, collect() discovers
        self.cgroups = HostCgroups(ctx.hostfs)  # the host's cgroup paths, also from a container's namespace
        self.applier = applier.Applier(ctx.hostfs, self.store, self.counters, ctx.clock)
        self._configure(ctx.config)

    def _configure(self, config: "Config") -> None:
        self.cfg = config.placement
        self._reconcile.period = self.cfg.reconcile_interval
        self.matcher = Matcher(self.cfg.selectors)
        self.policy = Policy(
            reserved=parse_cpulist(self.cfg.reserved_cpus),
            span_policy=self.cfg.span_policy,
            cpu_node=self.cfg.cpu_node,
            exclusive_cpus=dict(self.cfg.exclusive_cpus),
            tiers={t.name: t.tier for t in config.tenants},
        )

    @property
    def enforce(self) -> bool:
        return self.cfg.mode == "enforce"

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def probe(self, features: object) -> Verdict:
        topo = read_topology(self.ctx.hostfs, self._gpu_devices())
        usable = topo.online_cpus - self.policy.reserved
        if topo.online_cpus and not usable:
            return Verdict(State.UNAVAILABLE, f"reserved_cpus {self.cfg.reserved_cpus} leaves no online CPU")
        problems = []
        if not self.cfg.selectors and not self.cfg.gpu_processes:
            problems.append("no selectors and gpu_processes off: nothing is selected")
        if self.enforce and os.geteuid() != 0:
            problems.append("not root: affinity of other users' processes cannot be set")
        problems += topo.warnings
        return Verdict(State.DEGRADED if problems else State.ACTIVE, "; ".join(problems))

    def _gpu_devices(self) -> list[Any]:
        try:
            return list(self.ctx.gpu.devices())
        except Exception as e:  # noqa: BLE001 - no GPU description is a topology without NVML, not a failure
            self.log.warning("GPU devices unknown: %s", e)
            return []

    def start(self, plan: None = None) -> None:
        self.topology = read_topology(self.ctx.hostfs, self._gpu_devices())
        for w in self.topology.warnings:
            self.log.warning("topology: %s", w)
        try:
            self.store.load()
        except StateFileError as e:
            raise CapabilityError(f"{e}; move it away (or run `qosagent detach`) before starting placement") from None
        # Originals a crashed agent saved are the true originals of processes it pinned: adopt those still running.
        adopted = {}
        for pid, orig in self.store.entries.items():
            if proc_start(self.ctx.hostfs, pid) == orig.start:
                adopted[pid] = orig
        self.store.entries = adopted
        try:
            self.store.save()
        except OSError as e:
            raise CapabilityError(f"cannot keep original affinities under {self.ctx.config.state_dir}: {e}") from e
        if adopted:
            self.log.info("adopted saved original affinity of %d process(es) from an earlier agent", len(adopted))

    def stop(self) -> None:
        if not self.cfg.restore_on_stop:
            if self.store.entries:
                self.log.info("restore_on_stop off: %d process(es) stay pinned; `qosagent detach` restores them",
                              len(self.store.entries))
            return
        for line in applier.restore_all(self.ctx.hostfs, self.store):
            self.log.info("%s", line.removeprefix("placement: "))
        for rec in self.records.values():
            rec.applied = False

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        store = applier.OriginalsStore(ctx.config.state_dir)
        try:
            store.load()
        except StateFileError as e:
            return [f"placement: {e}; kept, restore the affinities it names by hand and remove it"]
        return applier.restore_all(ctx.hostfs, store) if store.entries else []

    def prepare(self, config: "Config") -> Change:
        old = self.ctx.config

        def commit() -> None:
            was_enforcing = self.enforce
            self._configure(config)
            # CPUs come and go (hotplug); a reload is when the operator expects the agent to look again.
            self.topology = read_topology(self.ctx.hostfs, self._gpu_devices())
            if was_enforcing and not self.enforce:
                # A dry run must not leave earlier pins behind as if they were still decided.
                for line in applier.restore_all(self.ctx.hostfs, self.store):
                    self.log.info("%s", line.removeprefix("placement: "))
                self.records = {}
            self._reconcile.again()

        def undo() -> None:
            # Pins a dry run restored come back at the next reconcile, which this forces.
            self._configure(old)
            self._reconcile.again()

        return Change(commit, undo)

    # ---- one tick ----------------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Whether this tick reconciles; if so, the page locality of the processes placed, read again where
        locality_interval has passed (their records show it), so that collect only reads."""
        now = self.ctx.clock()
        gpu = self.ctx.gpu_state
        if gpu is not None and gpu.available:
            gpu_pids = {p.pid for g in gpu.gpus for p in g.processes}
            if self.cfg.gpu_processes and gpu_pids != self._gpu_pids:
                self._reconcile.again()  # a new GPU process is placed now, not a whole reconcile interval later
            self._gpu_pids = gpu_pids
        self._reconciling = self._reconcile.due(now)
        if not self._reconciling:
            return
        if self._gpu_data_unknown(gpu):
            # A process whose GPU list is missing this tick would look GPU-less and be moved off its GPU's node.
            self._reconciling = False
            self.counters["errors"]["gpu_data_unknown"] += 1
            self.log.debug("reconcile skipped: GPU process lists unknown this tick")
            return
        for pid, rec in self.records.items():
            if now - rec.locality_at >= self.cfg.locality_interval and proc_start(self.ctx.hostfs, pid) == rec.start:
                rec.pages = numa_pages(self.ctx.hostfs, pid)
                rec.locality_at = now

    def collect(self) -> PlacementPart:
        assert self.topology is not None
        procs: tuple[ProcInfo, ...] = ()
        gone: frozenset[int] = frozenset()
        reconcile = self._reconciling
        gpus_of: dict[int, list[int]] = collections.defaultdict(list)
        if reconcile:
            gpu = self.ctx.gpu_state
            for g in gpu.gpus if gpu is not None and gpu.available else ():
                for p in g.processes:
                    gpus_of[p.pid].append(g.index)
            gpu_pids = self._gpu_pids if self.cfg.gpu_processes else set()
            procs = tuple(discover(self.ctx.hostfs, self.matcher, gpu_pids, own_pid=os.getpid(),
                                   cgroups=self.cgroups))
            seen = {p.pid for p in procs}
            gone = frozenset(pid for pid, rec in self.records.items()
                             if pid not in seen and proc_start(self.ctx.hostfs, pid) != rec.start)
        return PlacementPart(
            mode=self.cfg.mode, topology=self.topology, reconcile=reconcile, procs=procs, gone=gone,
            gpus={pid: tuple(sorted(g)) for pid, g in gpus_of.items()},
            records=tuple(r.as_dict() for r in sorted(self.records.values(), key=lambda r: r.pid)),
            counters={k: dict(v) for k, v in self.counters.items()},
            reserved_cpus=self.cfg.reserved_cpus,
        )

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        view = snapshot.part(PLACEMENT)
        if view is None or not view.reconcile:
            return []
        assert self.topology is not None
        targets = plan(view.procs, view.gpus, self.topology, self.policy)
        return policy.decide(view, targets, self.records, self.store.entries.keys(), self.enforce)

    def _gpu_data_unknown(self, gpu: Any) -> bool:
        assert self.topology is not None
        if not any(a.gpu_index is not None for a in self.topology.accelerators):
            return False  # no GPU known to NVML: every process is GPU-less, truly
        if gpu is None or not gpu.available:
            return True
        return any(g.lost or any(f in ("processes", "sample") for f, _ in g.errors) for g in gpu.gpus)

    def apply(self, decisions: list[Decision]) -> None:
        commands = [(d.command, d.wall_time) for d in decisions
                    if d.capability == self.name and isinstance(d.command, (Place, Drop))]
        self.applier.run(commands, self.records, applier.Settings(self.enforce, self.cfg.migrate_memory,
                                                                 self.topology))

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(PLACEMENT)
        return export.metrics(part) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(PLACEMENT)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)
