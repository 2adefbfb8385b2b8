"""NUMA placement: keep each selected inference process, its threads and its memory on the node of its GPUs.

Every reconcile_interval: discover the selected processes (collect), plan each one's CPUs and memory node and compare
with what its threads have now (decide), pin and migrate, then read the result back (apply). Processes are touched
only when a selector (or, opted in, NVML's compute-process list) names them. Originals are saved before the first
write, on disk under state_dir, and put back on stop (or by `qosagent detach` after a crash).
"""

from __future__ import annotations

import collections
import errno
import os
from typing import TYPE_CHECKING, Any, Iterable


from qosagent.capability import AgentContext, Capability, CapabilityError, Change, State, Verdict
from qosagent.placement import applier, export
from qosagent.placement.config import PlacementConfig
from qosagent.cpulist import format_cpulist, parse_cpulist
from qosagent.cgroups import HostCgroups
from qosagent.placement.model import Drop, PlacementPart, Place, Record
from qosagent.placement.discovery import Matcher, ProcInfo, discover, numa_pages, proc_start, thread_cpus
from qosagent.placement.planner import Policy, Target, plan
from qosagent.placement.topology import Topology, read_topology
from qosagent.schedule import Every
from qosagent.statefile import StateFileError
from qosagent.snapshot import Decision, Snapshot

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config


class Placement(Capability):
    name = "placement"

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
        view: PlacementPart | None = snapshot.part(self.name)
        if view is None or not view.reconcile:
            return []
        assert self.topology is not None
        targets = plan(view.procs, view.gpus, self.topology, self.policy)
        procs = {p.pid: p for p in view.procs}
        out: list[Decision] = []
        # Forgetting comes first: a pid reused by a new process must lose the old one's record and originals
        # before the new one is pinned and its own originals are saved.
        for pid, rec in sorted(self.records.items()):
            p = procs.get(pid)
            if pid in view.gone or (p is not None and p.start != rec.start):
                out.append(self._decision(pid, rec.name, "forget", rec.cpus, None, "exited", rec.gpus, applied=True,
                                          command=Drop(pid, release=False)))
            elif p is None:
                # Still running but no selector names it now (a reload): it gets its original affinity back.
                out.append(self._decision(pid, rec.name, "release", rec.cpus, None, "no longer selected", rec.gpus,
                                          applied=pid in self.store.entries, command=Drop(pid, release=True)))
        for p in view.procs:
            d = self._compare(p, targets[p.pid], self.records.get(p.pid))
            if d is not None:
                out.append(d)
        return out

    def _gpu_data_unknown(self, gpu: Any) -> bool:
        assert self.topology is not None
        if not any(a.gpu_index is not None for a in self.topology.accelerators):
            return False  # no GPU known to NVML: every process is GPU-less, truly
        if gpu is None or not gpu.available:
            return True
        return any(g.lost or any(f in ("processes", "sample") for f, _ in g.errors) for g in gpu.gpus)

    def _decision(self, pid: int, name: str, action: str, old: frozenset[int] | None, new: frozenset[int] | None,
                  reason: str, gpus: tuple[int, ...], command: Place | Drop, applied: bool | None = None,
                  **inputs: Any) -> Decision:
        return Decision(
            capability=self.name, target=f"pid {pid} ({name})", action=action,
            old=format_cpulist(old) if old is not None else None,
            new=format_cpulist(new) if new is not None else None, reason=reason,
            inputs={"pid": pid, "gpus": list(gpus), **inputs},
            applied=self.enforce if applied is None else applied, command=command,
        )

    def _compare(self, p: ProcInfo, t: Target, rec: Record | None) -> Decision | None:
        if rec is not None and rec.start != p.start:
            rec = None  # the pid names another program now; "forget" covers the old one
        threads = p.thread_cpus or {}
        current = threads.get(p.pid) or (next(iter(threads.values())) if threads else None)
        inputs = {"node": t.node, "selector": p.selector,
                  "cpuset": format_cpulist(p.cpuset) if p.cpuset is not None else None}
        if t.pinned:
            if rec is None or rec.cpus != t.cpus or rec.node != t.node or (self.enforce and not rec.applied):
                return self._decision(p.pid, p.name, "pin", current, t.cpus, t.reason, t.gpus,
                                      Place("pin", p, t, t.reason), **inputs)
            # A thread the application bound inside the target (one CPU of it, say) is placed, not drifted.
            off = {tid: c for tid, c in threads.items() if not c <= t.cpus}
            if self.enforce and off:
                tid, c = sorted(off.items())[0]
                why = f"drift: {len(off)} of {len(threads)} threads off target (tid {tid} on {format_cpulist(c)})"
                return self._decision(p.pid, p.name, "correct", c, t.cpus, why, t.gpus, Place("correct", p, t, why),
                                      **inputs)
            return None
        if rec is not None and rec.cpus is not None and p.pid in self.store.entries:
            return self._decision(p.pid, p.name, "restore", current, None, t.reason, t.gpus,
                                  Place("restore", p, t, t.reason), **inputs)
        if rec is None or rec.reason != t.reason or rec.cpus is not None:
            # Nothing is written; the decision is there so the audit says why this process was left alone.
            return self._decision(p.pid, p.name, "leave", current, current, t.reason, t.gpus,
                                  Place("leave", p, t, t.reason), applied=True, **inputs)
        return None

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            c = d.command
            if d.capability != self.name or not isinstance(c, (Place, Drop)):
                continue
            pid = c.pid if isinstance(c, Drop) else c.proc.pid
            action = ("release" if c.release else "forget") if isinstance(c, Drop) else c.action
            self.counters["actions"][action] += 1
            if action == "correct":
                self.counters["drift"]["corrected" if self.enforce else "seen"] += 1
            try:
                if isinstance(c, Drop):
                    self._drop(c)
                else:
                    self._place(c, d.wall_time)
            except applier.Exited:
                # Exited between discovery and the write: nothing to undo, nothing to keep.
                self.counters["errors"]["exited"] += 1
                self.records.pop(pid, None)
                self.store.entries.pop(pid, None)
            except OSError as e:
                self.counters["errors"]["permission" if isinstance(e, PermissionError) else "write"] += 1
                rec = self.records.get(pid)
                if rec is not None:
                    rec.applied = False
                    rec.last_action = "error"
                    rec.reason = f"{action} failed: {e.strerror or e}"
                self.log.warning("pid %d: %s failed: %s", pid, action, e)
        self._save_store()

    def _save_store(self) -> None:
        try:
            self.store.save()
        except OSError as e:
            self.counters["errors"]["state_dir"] += 1
            self.log.warning("cannot save original affinities: %s", e)

    def _restore(self, pid: int, orig: applier.Original) -> applier.AffinityResult:
        """The original back, forgotten only once written: a failed write keeps it (memory and state file) for a
        later tick, stop() or `qosagent detach`. A process gone is nothing to restore (applier.Exited)."""
        try:
            res = applier.restore(self.ctx.hostfs, pid, orig)
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.ENOENT):
                raise applier.Exited(f"pid {pid} exited") from None
            raise
        self.store.entries.pop(pid, None)
        return res

    def _drop(self, c: Drop) -> None:
        orig = self.store.entries.get(c.pid)
        if c.release and orig is not None:
            self._restore(c.pid, orig)  # on failure the record stays too, so a later reconcile releases again
        self.store.entries.pop(c.pid, None)
        self.records.pop(c.pid, None)

    def _place(self, c: Place, at: float) -> None:
        fs = self.ctx.hostfs
        p, t, pid = c.proc, c.target, c.proc.pid
        rec = self.records.get(pid)
        if rec is None or rec.start != p.start:
            rec = self.records[pid] = Record(pid, p.start, p.name, p.selector)
        rec.gpus, rec.last_action, rec.reason, rec.at = t.gpus, c.action, c.reason, at
        if c.action == "leave":
            rec.node, rec.cpus, rec.applied, rec.verified = None, None, False, None
            return
        if c.action == "restore":
            rec.threads = self._restore(pid, self.store.entries[pid]).threads
            rec.node, rec.cpus, rec.applied, rec.verified = None, None, True, None
            return
        rec.node, rec.cpus = t.node, t.cpus
        if not self.enforce:
            rec.applied = False
            return
        assert t.cpus is not None and self.topology is not None
        if pid not in self.store.entries:
            before = applier.get_affinity(fs, pid)
            self.store.entries[pid] = applier.Original(p.start, before, before.get(pid, next(iter(before.values()))))
            self._save_store()  # before the first write: a crash right after it must still be undoable
        res = applier.set_affinity(fs, pid, t.cpus, keep_subsets=True)
        rec.threads, rec.applied = res.threads + res.kept, True
        if c.action == "pin" and self.cfg.migrate_memory and t.node is not None and self.topology.numa:
            try:
                m = applier.migrate(fs, pid, t.node, self.topology.memory_nodes())
            except OSError as e:
                self.counters["migrations"]["failed"] += 1
                self.log.warning("pid %d: migrate_pages to node %s failed: %s", pid, t.node, e)
            else:
                self.counters["migrations"]["noop" if m.noop else "moved"] += 1
                self.counters["pages_migrated"]["moved"] += m.moved
                self.counters["pages_migrated"]["not_moved"] += m.not_moved
                rec.pages, rec.locality_at = m.pages, self.ctx.clock()
        back = thread_cpus(fs, pid)
        if not back:
            raise applier.Exited(f"pid {pid} exited")
        rec.verified = all(c <= t.cpus for c in back.values())
        if not rec.verified:
            self.counters["drift"]["unverified"] += 1

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot) -> Iterable["Metric"]:
        part = snapshot.part(self.name)
        return export.metrics(part) if isinstance(part, PlacementPart) else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(self.name)
        return export.status(part) if isinstance(part, PlacementPart) else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)
