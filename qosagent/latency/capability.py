"""Per-tenant request latency and run-queue latency, measured in the kernel by bpf/latency_*.c: the latency
capability's face (probe, start, prepare, maintain, collect, stop), wiring its probe planning (planning.py), its
datapath (datapath.py: the loaded program and its maps), the hooks that follow cgroups and connections (hooks.py),
the pods' addresses (pods.py), the tick's read as the part (reading.py) and what it shows (export.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Container, Iterable, Mapping

from qosagent import netns, sandbox
from qosagent.capability import (UNCHANGED, AgentContext, Attention, Capability, CapabilityError, Change, State,
                                 Verdict, rewrite)
from qosagent.ebpf import pinned
from qosagent.latency import bpfmaps, datapath, export, hooks, planning, reading, runq
from qosagent.latency.datapath import Datapath
from qosagent.latency.model import LATENCY, SHARED_TIER, LatencyPart, Plan
from qosagent.latency.pods import PodTenants
from qosagent.latency.slots import MapsPlan
from qosagent.pods.service import Pods
from qosagent.retention import EVERYONE
from qosagent.sandbox import Need
from qosagent.schedule import Every
from qosagent.slo import SloVerdict
from qosagent.tenants import UNMATCHED_ID, TenantInfo

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features
    from qosagent.snapshot import Snapshot

log = logging.getLogger("qosagent.latency")

RUNQ_REFRESH_S = 1.0  # how often the threads of the serving processes are re-listed


class Latency(Capability):
    name = "latency"
    uses = (netns.Follower, Pods)
    loads_bpf = True

    @classmethod
    def sandbox_needs(cls, config: "Config") -> list[Need]:
        return [
            Need("CapabilityBoundingSet", "CAP_BPF", "create maps, load programs"),
            Need("CapabilityBoundingSet", "CAP_PERFMON", "attach tracepoints and kprobes"),
            Need("CapabilityBoundingSet", "CAP_NET_ADMIN", "attach sock_ops and cgroup_skb programs"),
            Need("RequiresMountsFor", "/sys/kernel/tracing", "tracefs: the tracepoints' and kprobes' ids"),
            *sandbox.perf_events("attach tracepoints and kprobes (perf_event_open)"),
            # sockops mode (auto may choose it) links the cgroups of the processes that hold a listening socket.
            *sandbox.other_processes("find the pods' network namespaces (/proc/PID/ns/net) and, in sockops mode, "
                                     "the serving processes by their sockets (/proc/PID/fd)",
                                     fds=config.latency.mode not in ("tracepoint", "kprobe")),
        ]

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.mode = ""  # "sockops", "tracepoint" or "kprobe"
        self.runq = False
        self.arrival = False  # request clocks start at arrival (sock:sk_data_ready), else at the first read
        self.dp: Datapath | None = None  # the loaded program and its maps
        self.hooks: hooks.Upkeep | None = None  # the hooks that follow cgroups and connections (hooks.py)
        self.programs: list[dict[str, Any]] = []
        self._known: dict[int, TenantInfo] = {}
        self._tenants: dict[int, TenantInfo] = {}  # the config's tenants, as of the last start or reload
        self._names: tuple[object, dict[int, str]] = (None, {})  # a plan's tenants, and their names by id
        self._maps: MapsPlan | None = None  # what the tenant and port maps say (the last start or reload)
        self._tracked: set[int] = set()  # its tracked ports (config.tracked_ports walks every tenant's)
        # What the tick makes of each tenant's rows, kept between ticks (reading.py).
        self._view = reading.Tenants(ctx.config.latency.window)
        # The configured tenants' SLOs and their tiers', as of the last start or reload (SloVerdict's).
        self._slos: tuple[dict[str, float], dict[str, float]] = ({}, {})
        self._published: tuple[tuple[Any, ...], LatencyPart] | None = None  # the last part, and what it was made of
        # Re-listing the serving processes' threads (run-queue) and pruning the links of cgroups gone (sockops).
        self._refresh = Every(RUNQ_REFRESH_S)
        self._threads = runq.Threads()
        self._runq_names: dict[int, str] = {}  # run-queue row -> the name of its tier (SHARED_TIER: several)
        # process and pods tenants by their serving namespaces' addresses (lat_netns)
        self._pods: PodTenants | None = None

    # ---- probe and start ---------------------------------------------------------------------------------
    def probe(self, features: "Features") -> Verdict:
        return planning.verdict(self.ctx.config.latency, features)

    def begin(self, features: "Features") -> None:
        verdict = self.probe(features)
        if verdict.state is not State.UNAVAILABLE:
            Datapath.begin(self.ctx.config, verdict.plan)

    def start(self, plan: Plan) -> None:
        self.mode, self.arrival, self.runq = plan.mode, plan.arrival, plan.runq
        self.dp = dp = Datapath.load(self.ctx.config, plan, self.ctx.hostfs)
        self._pods = PodTenants(self.ctx.services, self.ctx.hostfs, dp.map("lat_netns"), dp.map("lat_netns_conf"),
                                self.ctx.clock)
        self._maps = None
        self.hooks = hooks.Upkeep(dp, self.ctx.hostfs, self.ctx.clock, plan, self._serving_namespaces)
        try:
            self.hooks.start(set(self.ctx.config.tracked_ports()), lambda: self._write_maps(dp.plan(self.ctx.config)))
        except CapabilityError:
            self._release()
            raise
        self.programs = dp.program_ids(self.ctx.hostfs)
        log.info("latency probes attached (%s mode, %d programs, clock from %s, run-queue %s) on ports %s",
                 self.mode, self.attached(), "arrival" if self.arrival else "first read",
                 "on" if self.runq else "off", self.ctx.config.tracked_ports())
        self.verdict = self.verified(self.verdict)

    def verified(self, verdict: Verdict) -> Verdict:
        assert self.hooks is not None
        return self.hooks.verified(verdict, set(self.ctx.config.tracked_ports()))

    def _release(self) -> None:
        """Undo what start() did, in reverse: the hooks, then the programs and maps."""
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    def attached(self) -> int:
        if self.dp is None:
            return 0
        return self.dp.attached() + (self.hooks.attached() if self.hooks is not None else 0)

    # ---- maps from config --------------------------------------------------------------------------------
    def _write_maps(self, m: MapsPlan) -> None:
        """The program's maps made to say what m says, then what follows from it: tenants known, pods followed, the
        window (when its length changed)."""
        assert self.dp is not None
        self.dp.write(m)
        self._known.update(m.tenants)
        self._tenants = m.tenants
        self._follow_pods(m)
        self._view.configure(m.tenants, self._known, m.window)
        self._maps = m
        self._tracked = set(m.tracked)
        self._runq_names = {bpfmaps.RUNQ_SHARED: SHARED_TIER, **{row: tier for tier, row in m.runq_rows.items()}}
        self._slos = ({info.name: info.slo_p99 for info in m.tenants.values()},
                      {info.tier: info.slo_p99 for tid, info in m.tenants.items() if tid != UNMATCHED_ID})

    def _serving_namespaces(self, ports: set[int]) -> list[netns.ServingNs]:
        """The other network namespaces where one of ports listens (pods), from the agent's one scan, as the maps in
        force say (during a reload's commit, the new config's, which the context holds only after it)."""
        assert self._maps is not None
        found = self.ctx.service(netns.Follower).current(
            self._maps.tracked, any(not r.by_pod for r in self._maps.namespace_rules), self.ctx.clock())
        return [ns for ns in found.values() if ns.ports & ports]

    def _follow_pods(self, m: MapsPlan) -> None:
        """Process and pods tenants' serving namespaces into lat_netns (qosagent/latency/pods.py), as they come and
        go."""
        assert self._pods is not None
        if self._names[0] is not m.tenants:  # named once a plan, not every follow (once a second)
            self._names = (m.tenants, {t: i.name for t, i in m.tenants.items()})
        # The pods settings in force (a reload's new ones from the next follow on); only start lists before the first.
        self._pods.follow(m.namespace_rules, m.tracked, self.ctx.clock(), self._names[1], self.ctx.config.pods,
                          starting=self._maps is None)

    def prepare(self, config: "Config") -> Change:
        if self.dp is None:
            return UNCHANGED
        new, old = self.dp.plan(config), self._maps
        assert old is not None
        return rewrite(self._write_maps_adopting, new, old, "tenant maps")

    def _write_maps_adopting(self, m: MapsPlan) -> None:
        """_write_maps, then the connections already open on the ports m newly tracks taken under observation."""
        assert self._maps is not None and self.hooks is not None
        self.hooks.write_adopting(set(m.tracked) - set(self._maps.tracked), lambda: self._write_maps(m))

    # ---- each tick ---------------------------------------------------------------------------------------
    def maintain(self) -> None:
        now = self.ctx.clock()
        if not self._refresh.due(now):
            return
        assert self.dp is not None and self.hooks is not None
        assert self._maps is not None
        if self.runq:
            self._threads.refresh(self.dp.map("runq_tgids"), self.dp.map("runq_pids"), self.ctx.hostfs,
                                  self._maps.slot_rows)
        self.hooks.maintain(self._tracked)
        self._follow_pods(self._maps)

    def collect(self) -> LatencyPart:
        now = self.ctx.clock()
        assert self.dp is not None and self.hooks is not None
        changes = self.dp.read()
        cfg = self.ctx.config
        adm = cfg.admission
        view = self._view
        view.update(now, changes, adm.signal)
        seen = self.hooks.verified_by_traffic(view.counted, now, self._tracked, cfg.latency.verify_within,
                                              view.egress_unread)
        if seen is not None:
            self.verdict = seen
        found, unobserved = self.hooks.found(), self.hooks.unobserved()
        hooks = self.hooks.view(self.attached(), self.programs, view.egress_unread)
        namespaces = self._pods.followed if self._pods is not None else ()
        made = (view.version, cfg, self._slos, self._runq_names, found, unobserved, hooks, namespaces,
                changes.rows_read)
        if self._published is not None and self._published[0] == made:
            return self._published[1]  # a tick at rest: nothing in the part would differ, no tenant's row copied
        rq = view.runqueue(self._runq_names) if self.runq else None
        slos, tier_slo = self._slos
        verdict = SloVerdict(view.windows, slos, tier_slo, adm.signal, adm.quantile, adm.near_slo,
                             adm.healthy_below, frozenset(view.busy))
        part = LatencyPart(window_s=cfg.latency.window, tenants=view.tenants,
                           runqueue=rq.total if rq else None, runqueue_window=rq.window if rq else None,
                           runqueue_tiers=rq.tiers if rq else {}, runqueue_tiers_window=rq.tiers_window if rq else {},
                           found_open=found, unobserved=unobserved, hooks=hooks, slo=slos, namespaces=namespaces,
                           verdict=verdict, rows_read=changes.rows_read)
        self._published = (made, part)
        return part

    def quiet(self) -> bool:
        # What no tenant claims (the agent's own reads of a server's metrics on its API port, probes) and the run
        # queue move no decision, and do not keep the loop awake.
        return not self._view.rows_moved

    def kernel_maps(self, plan: Plan) -> list[Any]:
        return datapath.map_sizes(self.ctx.config, plan)

    def stop(self) -> None:
        """Everything attached goes with the agent; the build stays pinned for the next agent to reuse, unless
        ctx.detach_on_exit."""
        if self.dp is None:
            return
        self._release()
        log.info("latency probes detached")
        if self.ctx.detach_on_exit:
            for line in self.detach(self.ctx):
                log.info("%s", line)

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        """The builds a stopped agent kept (nothing of latency stays attached without an agent)."""
        return pinned.remove_builds(ctx.config.bpf.pin_root, "latency")

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: "Snapshot", shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(LATENCY)
        cfg = self.ctx.config
        yield from export.families(part, part.hooks.attached if part is not None else 0, cfg.admission.signal,
                                   cfg.admission.quantile, cfg.latency.classic_buckets, shown,
                                   cfg.latency.tier_histograms, cfg.metrics.deprecated_names)

    def traffic(self, snapshot: "Snapshot") -> Mapping[str, tuple[int, ...]]:
        part = snapshot.part(LATENCY)
        return export.traffic(part) if part is not None else {}

    def status(self, snapshot: "Snapshot") -> dict[str, Any]:
        part = snapshot.part(LATENCY)
        adm = self.ctx.config.admission
        return export.status(part, dict(part.slo), adm.signal, adm.quantile) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)

    @staticmethod
    def attention(status: dict[str, Any]) -> dict[str, Attention]:
        return export.attention(status)

