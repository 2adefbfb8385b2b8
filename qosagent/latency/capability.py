"""Per-tenant request latency and run-queue latency, measured in the kernel by bpf/latency_*.c.

The kernel keeps cumulative histograms (shared by all CPUs) and counters (per CPU) in rows per tenant slot; each
tick reads the rows of the slots in use, sums the counters' CPUs and builds the LatencyPart: since-start histograms
as read, window histograms as the difference to a checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from qosagent import netns
from qosagent.capability import UNCHANGED, Capability, CapabilityError, Change, State, Verdict, rewrite
from qosagent.ebpf.libbpf import ATTACH_CGROUP_INET_EGRESS
from qosagent.hist import Histogram, Since
from qosagent.latency import adopt, export, links, planning, runq, selftest
from qosagent.latency import bpfmaps as bm
from qosagent.latency.cgroupwatch import CgroupWatch
from qosagent.latency.datapath import Datapath
from qosagent.latency.model import LATENCY, Hooks, LatencyPart, Plan, TenantLatency
from qosagent.latency.pods import PodTenants
from qosagent.latency.slots import MapsPlan
from qosagent.latency.window import Window
from qosagent.pods.service import Pods
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
_EMPTY: dict[int, int] = {}


class Latency(Capability):
    name = "latency"
    uses = (netns.Follower, Pods)
    loads_bpf = True

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.mode = ""  # "sockops", "tracepoint" or "kprobe"
        self.runq = False
        self.arrival = False  # request clocks start at arrival (sock:sk_data_ready), else at the first read
        self.egress = False  # responses are read as they leave (TTFT, inter-token): a cgroup_skb egress program
        self._egress_error = "no cgroup v2 hierarchy for the egress program"  # why not, when not
        self._egress_lost = False  # probe promised it, start could not attach it
        self.dp: Datapath | None = None  # the loaded program and its maps
        self.programs: list[dict[str, Any]] = []
        self._known: dict[int, TenantInfo] = {}
        self._tenants: dict[int, TenantInfo] = {}  # the config's tenants, as of the last start or reload
        self._maps: MapsPlan | None = None  # what the tenant and port maps say (the last start or reload)
        self._window: Window[bm.Raw] | None = None
        # Re-listing the serving processes' threads (run-queue) and pruning the links of cgroups gone (sockops).
        self._refresh = Every(RUNQ_REFRESH_S)
        self.watch: CgroupWatch | None = None  # sockops mode: the hooks on the cgroup2 root and serving cgroups
        self._egress_root_link: int | None = None  # tracepoint and kprobe modes: lat_egress on the cgroup2 root
        self.adopter: adopt.Adopter | None = None  # connections open before their port was watched
        # process and pods tenants by their serving namespaces' addresses (lat_netns)
        self._pods: PodTenants | None = None

    # ---- probe and start ---------------------------------------------------------------------------------
    def probe(self, features: "Features") -> Verdict:
        return planning.verdict(self.ctx.config.latency, features)

    def start(self, plan: Plan) -> None:
        self.mode, self.arrival, self.egress, self.runq = plan.mode, plan.arrival, plan.egress, plan.runq
        self.dp = dp = Datapath.load(self.ctx.config, plan)
        self._pods = PodTenants(self.ctx.services, self.ctx.hostfs, dp.map("lat_netns"), dp.map("lat_netns_conf"),
                                self.ctx.clock)
        self._maps = None
        adopt.set_listing(dp.bpf, True)
        self._write_maps(dp.plan(self.ctx.config))
        tracked = set(self.ctx.config.tracked_ports())
        root = None
        # Maps first, hooks last: a connection established before the tenant maps were written would be resolved
        # against empty ones.
        if self.mode == "sockops":
            self.watch = CgroupWatch(dp.bpf, self.ctx.hostfs, links.cgroup_root(self.ctx.hostfs), self.ctx.clock)
            try:
                self.watch.start(tracked, [p for ns in self._serving_namespaces(tracked) for p in ns.pids])
            except CapabilityError:
                self._release()
                raise
        elif self.egress:
            root = self._attach_egress_root()
        self.adopter = adopt.Adopter(dp.bpf, self.ctx.hostfs, self.ctx.clock, self.watch, root,
                                     elsewhere=self._serving_pids)
        self.adopter.open(tracked)
        self.programs = dp.program_ids(self.ctx.hostfs)
        log.info("latency probes attached (%s mode, %d programs, clock from %s, run-queue %s) on ports %s",
                 self.mode, self.attached(), "arrival" if self.arrival else "first read",
                 "on" if self.runq else "off", self.ctx.config.tracked_ports())
        self.verdict = self.verified(self.verdict)

    def verified(self, verdict: Verdict) -> Verdict:
        """verdict as what started bears out: lowered where the egress program could not be attached, or where a
        hook attached on every socket's path was not seen running."""
        if self._egress_lost:
            why = f"time to first token and inter-token latency unavailable: {self._egress_error}"
            verdict = Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, why) if r))
        # Active only once the hooks were seen running (qosagent/latency/selftest.py): those on every socket's path.
        rooted = self.watch.rooted() if self.watch is not None else []
        rooted += ["lat_egress"] if self._egress_root_link is not None else []
        assert self.dp is not None
        try:
            silent = selftest.check(self.dp.fds(rooted + self.dp.traced()), set(self.ctx.config.tracked_ports()))
        except selftest.Unverifiable as e:
            # Said, not degraded: the documented unit runs without CAP_SYS_ADMIN, and a capability degraded on every
            # such host would be a false alarm (and an agent never ready).
            log.info("%s", e)
            return Verdict(verdict.state, "; ".join(r for r in (verdict.reason, str(e)) if r))
        if silent:
            log.warning("%s", silent)
            verdict = Verdict(State.DEGRADED, "; ".join(r for r in (verdict.reason, silent) if r))
        return verdict

    def _attach_egress_root(self) -> str | None:
        """lat_egress on the cgroup2 root, for the whole run: in tracepoint and kprobe modes it finds a response's
        socket by the packet's addresses, whichever cgroup sends it; the root, or None where it could not be linked.
        Where it cannot be (a verifier of another kernel refusing the parser, say), the send hooks still time the
        headers and responses: TTFT and inter-token latency are unavailable, with the reason, and nothing else."""
        try:
            root = links.cgroup_root(self.ctx.hostfs)
            self._egress_root_link = links.link_root(self.ctx.hostfs, root, links.load_egress(self.dp.bpf).fd,
                                                     ATTACH_CGROUP_INET_EGRESS)
        except Exception as e:  # noqa: BLE001 - bcc raises plain Exception when loading
            self.egress = False
            self._egress_lost = True
            self._egress_error = f"the egress program could not be attached: {e}"
            log.warning("%s; time to first token and inter-token latency unavailable", self._egress_error)
            return None
        return root

    def _release(self) -> None:
        """Undo what start() did, in reverse: the adopter's link, the cgroup watcher and its links, the egress link
        on the root, the programs and maps."""
        if self.adopter is not None:
            self.adopter.close()
            self.adopter = None
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        links.close(self._egress_root_link)
        self._egress_root_link = None
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    def attached(self) -> int:
        if self.dp is None:
            return 0
        n = self.dp.attached()
        n += self.watch.attached() if self.watch is not None else 0
        n += 1 if self._egress_root_link is not None else 0
        return n + (self.adopter.attached() if self.adopter is not None else 0)

    # ---- maps from config --------------------------------------------------------------------------------
    def _write_maps(self, m: MapsPlan) -> None:
        """The program's maps made to say what m says, then what follows from it: tenants known, pods followed, the
        window (when its length changed)."""
        assert self.dp is not None
        self.dp.write(m)
        self._known.update(m.tenants)
        self._tenants = m.tenants
        self._follow_pods(m)
        if self._maps is None or self._maps.window != m.window:
            self._window = Window(m.window)
        self._maps = m

    def _serving_namespaces(self, ports: set[int]) -> list[netns.ServingNs]:
        """The other network namespaces where one of ports listens (pods), from the agent's one scan, as the maps in
        force say (during a reload's commit, the new config's, which the context holds only after it)."""
        assert self._maps is not None
        found = self.ctx.service(netns.Follower).current(
            self._maps.tracked, any(not r.by_pod for r in self._maps.namespace_rules), self.ctx.clock())
        return [ns for ns in found.values() if ns.ports & ports]

    def _serving_pids(self, ports: set[int]) -> list[int]:
        """A process in each serving namespace (pods), whose /proc entries list the namespace's sockets."""
        return [ns.pid for ns in self._serving_namespaces(ports)]

    def _follow_pods(self, m: MapsPlan) -> None:
        """Process and pods tenants' serving namespaces into lat_netns (qosagent/latency/pods.py), as they come and
        go."""
        assert self._pods is not None
        # The pods settings in force (a reload's new ones from the next follow on); only start lists before the first.
        self._pods.follow(m.namespace_rules, m.tracked, self.ctx.clock(), {t: i.name for t, i in m.tenants.items()},
                          self.ctx.config.pods, starting=self._maps is None)

    def prepare(self, config: "Config") -> Change:
        if self.dp is None:
            return UNCHANGED
        new, old = self.dp.plan(config), self._maps
        assert old is not None
        return rewrite(self._write_maps_adopting, new, old, "tenant maps")

    def _write_maps_adopting(self, m: MapsPlan) -> None:
        """_write_maps, then the connections already open on the ports m newly watches taken under observation."""
        assert self._maps is not None
        added = set(m.tracked) - set(self._maps.tracked)
        assert self.adopter is not None and self.dp is not None
        try:
            adopt.set_listing(self.dp.bpf, bool(added))
            self._write_maps(m)
            if added:
                self.adopter.open(added)
        finally:
            adopt.set_listing(self.dp.bpf, False)

    # ---- each tick ---------------------------------------------------------------------------------------
    def maintain(self) -> None:
        now = self.ctx.clock()
        if not self._refresh.due(now):
            return
        assert self.dp is not None
        if self.runq:
            runq.refresh_threads(self.dp.map("runq_tgids"), self.dp.map("runq_pids"), self.ctx.hostfs)
        assert self.adopter is not None
        self.adopter.maintain(set(self.ctx.config.tracked_ports()))
        assert self._maps is not None
        self._follow_pods(self._maps)
        if self.watch is not None:
            self.watch.maintain()

    def collect(self) -> LatencyPart:
        now = self.ctx.clock()
        assert self.dp is not None
        raw = self.dp.read_raw()
        assert self._window is not None
        base_t, base = self._window.push(now, raw)
        elapsed = now - base_t
        cfg = self.ctx.config
        current = self._tenants
        # Configured tenants, and any a reload removed that still have counts since start.
        ids = set(current) | {t for (t, _kind) in raw.hist} | {t for (t, _what) in raw.counters}
        tenants = {}
        for tid in sorted(ids):
            info = current.get(tid) or self._known.get(tid) or TenantInfo(tid, f"id-{tid}", "none", 0, 0.0)
            tenants[info.name] = self._tenant(info, raw, base, elapsed)
        runq = self._hist(raw, UNMATCHED_ID, bm.KIND_RUNQ) if self.runq else None
        slos = {info.name: info.slo_p99 for info in current.values()}
        adm = cfg.admission
        verdict = SloVerdict({n: (t.tier, t.window(adm.signal)) for n, t in tenants.items()}, slos,
                        {t.tier: cfg.tiers[t.tier].slo_p99 for t in cfg.tenants}, adm.signal, adm.quantile,
                        adm.near_slo, adm.healthy_below)
        return LatencyPart(
            window_s=cfg.latency.window,
            tenants=tenants,
            runqueue=runq,
            runqueue_window=Since(runq, self._hist(base, UNMATCHED_ID, bm.KIND_RUNQ)) if runq is not None else None,
            found_open=self.adopter.found if self.adopter is not None else 0,
            unobserved=self.adopter.unobserved() if self.adopter is not None else {},
            hooks=self._hooks(),
            slo=slos,
            namespaces=self._pods.followed if self._pods is not None else (),
            verdict=verdict,
        )

    def _hooks(self) -> Hooks:
        w = self.watch
        return Hooks(
            mode=self.mode, attached=self.attached(), programs=tuple((p["name"], p["id"]) for p in self.programs),
            ttft=("measured: responses read as they leave" if self.egress else f"unavailable: {self._egress_error}"),
            cgroups=tuple(w.cgroups()) if w is not None else (), learning=w is not None and w.learning,
            cgroup_errors=w.errors if w is not None else 0)

    @staticmethod
    def _hist(raw: bm.Raw, tid: int, kind: int) -> Histogram:
        # Not copied: RowParser makes a new dict for each changed row and never touches one it has handed out.
        return Histogram(raw.hist.get((tid, kind), _EMPTY), raw.sums.get((tid, kind), 0))

    def _tenant(self, info: TenantInfo, raw: bm.Raw, base: bm.Raw, elapsed: float) -> TenantLatency:
        tid = info.id

        def c(r: bm.Raw, what: int) -> int:
            return r.counters.get((tid, what), 0)

        def since(kind: int) -> tuple[Histogram, Histogram]:
            h = self._hist(raw, tid, kind)
            return h, Since(h, self._hist(base, tid, kind))

        headers, headers_window = since(bm.KIND_HEADERS)
        ttft, ttft_window = since(bm.KIND_TTFT)
        resp, resp_window = since(bm.KIND_RESPONSE)
        itl, itl_window = since(bm.KIND_ITL)
        return TenantLatency(
            tenant=info.name,
            tier=info.tier,
            requests=resp.count,
            headers=headers,
            ttft=ttft,
            response=resp,
            inter_token=itl,
            headers_window=headers_window,
            ttft_window=ttft_window,
            response_window=resp_window,
            inter_token_window=itl_window,
            rate_rps=resp_window.count / elapsed if elapsed > 0 else 0.0,
            in_flight=max(c(raw, bm.C_STARTED) - resp.count - c(raw, bm.C_UNPAIRED_CLOSE), 0),
            unpaired=c(raw, bm.C_UNPAIRED_SEND) + c(raw, bm.C_UNPAIRED_CLOSE),
            overlapped=c(raw, bm.C_OVERLAPPED),
            unpaired_send=c(raw, bm.C_UNPAIRED_SEND),
            unpaired_close=c(raw, bm.C_UNPAIRED_CLOSE),
            pipelined=c(raw, bm.C_PIPELINED),
            connections=c(raw, bm.C_CONNS),
            multiplexed_connections=c(raw, bm.C_MUX_CONNS),
            lost=c(raw, bm.C_LOST),
            untracked=c(raw, bm.C_UNTRACKED),
            no_ttft={reason: n for reason, what in bm.NO_TTFT_REASONS.items() if (n := c(raw, what))},
            interim=c(raw, bm.C_INTERIM),
            framed=c(raw, bm.C_FRAMED),
            adopted=c(raw, bm.C_ADOPTED),
        )

    def stop(self) -> None:
        if self.dp is None:
            return
        self._release()
        log.info("latency probes detached")

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: "Snapshot") -> Iterable["Metric"]:
        part = snapshot.part(LATENCY)
        adm = self.ctx.config.admission
        fams = export.families(part, part.hooks.attached if part is not None else 0, adm.signal, adm.quantile,
                               self.ctx.config.latency.classic_buckets)
        yield from export.with_deprecated(fams) if self.ctx.config.metrics.deprecated_names else fams

    def status(self, snapshot: "Snapshot") -> dict[str, Any]:
        part = snapshot.part(LATENCY)
        if part is None:
            return {}
        adm = self.ctx.config.admission
        out = export.status(part, dict(part.slo), adm.signal, adm.quantile)
        h = part.hooks
        out["mode"] = h.mode
        out["ttft"] = h.ttft
        out["programs"] = [{"name": n, "id": i} for n, i in h.programs]
        if h.mode == "sockops":
            out["cgroups"] = list(h.cgroups)
            out["learning"] = h.learning
            out["cgroup_errors"] = h.cgroup_errors
        return out

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)

