"""Per-tenant quotas in the kernel: the quota capability's face (probe, start, collect, prepare, stop, detach),
the adaptive-limit writer offered to admission, and its metrics and status."""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from qosagent import listeners, netns
from qosagent.capability import UNCHANGED, AgentContext, Capability, CapabilityError, Change, State, Verdict, rewrite
from qosagent.config import UNMATCHED, Config
from qosagent.hostfs import HostFS
from qosagent.pods import service as pods_service
from qosagent.pods.cri import CriError, grpc_module
from qosagent.pods.service import Pods
from qosagent.quota import datapath as dp
from qosagent.quota import tc
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.quota.rules import Bucket, baseline, bucket, with_floor
from qosagent.schedule import Every
from qosagent.snapshot import Snapshot
from qosagent.tenants import UNMATCHED_ID, TenantInfo, TenantLimit, tenant_id, tenant_table

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.features import Features

log = logging.getLogger("qosagent.quota")


def interfaces(cfg: Config, fs: HostFS) -> list[str]:
    """quota.interfaces, or lo plus the interfaces whose addresses a listener on a watched port is bound to."""
    if cfg.quota.interfaces:
        return list(cfg.quota.interfaces)
    import psutil

    bound = set()
    for s in listeners.on_ports(fs, cfg.watched_ports()):
        try:
            bound.add(s.address)
        except (ValueError, OSError):
            continue  # a row the kernel would not write
    out = ["lo"]
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name == "lo":
            continue
        ips = {a.address.split("%")[0] for a in addrs if a.family.name in ("AF_INET", "AF_INET6")}
        if ips and (bound & ips or bound & {"0.0.0.0", "::"}):
            out.append(name)
    return out


def _baseline_buckets(cfg: Config) -> dict[int, tuple[Bucket | None, Bucket | None]]:
    out = {}
    for name, spec in baseline(cfg).items():
        req = bucket(spec.requests.rps, spec.requests.burst) if spec.requests else None
        conn = bucket(spec.connections.rps, spec.connections.burst) if spec.connections else None
        if req or conn:
            out[tenant_id(name)] = (req, conn)
    return out


@dataclass(frozen=True)
class _Written:
    """What a config makes of the datapath: kept for the old config too, so a reload can be undone."""

    config: Config
    interfaces: list[str]
    derived: tuple[dict[str, Any], dict[int, TenantInfo]]
    overrides: dict[str, TenantLimit]


class LimitsWriter:
    """tenants.LimitsWriter over the quota maps: overrides are clamped to the tier floor and expire in the kernel
    with the heartbeat."""

    def __init__(self, quota: "Quota"):
        self.quota = quota

    def baseline(self) -> Mapping[str, TenantLimit]:
        return {n: s.requests for n, s in self.quota.specs.items() if s.requests is not None}

    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        specs = self.quota.specs
        out = {}
        for name, lim in limits.items():
            if name not in specs:  # e.g. removed by a reload the caller has not seen yet
                log.warning("override for unknown tenant %r ignored", name)
                continue
            lim = with_floor(lim, specs[name].floor)
            out[tenant_id(name)] = bucket(lim.rps, lim.burst)
        self.quota.overrides = {n: v for n, v in limits.items() if n in specs}
        if self.quota.datapath is not None:
            self.quota.datapath.set_overrides(out)


class FleetWriter:
    """tenants.FleetWriter over the quota maps: each share is one more limit (the lowest holds), ending in the
    kernel with its lease or the heartbeat."""

    def __init__(self, quota: "Quota"):
        self.quota = quota

    def set_shares(self, shares: Mapping[str, tuple[TenantLimit, int]]) -> None:
        known = {n: v for n, v in shares.items() if n in self.quota.specs}
        self.quota.fleet = known
        if self.quota.datapath is not None:
            self.quota.datapath.set_fleet({tenant_id(n): (bucket(lim.rps, lim.burst), until)
                                           for n, (lim, until) in known.items()})


class Quota(Capability):
    name = "quota"
    uses = (netns.Follower, Pods)
    loads_bpf = True

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.datapath: dp.Datapath | None = None
        self.overrides: dict[str, TenantLimit] = {}
        self.fleet: dict[str, tuple[TenantLimit, int]] = {}  # tenant -> fleet share, end of its lease (ktime ns)
        self.attached: list[str] = []
        self.others: list[str] = []
        # Serving network namespaces followed: the host-side veths into each (inode -> (ifindex, name)), where the
        # classifier is on egress, and what status shows of them.
        self.egress: dict[int, list[tuple[int, str]]] = {}
        self.followed: tuple[dict[str, Any], ...] = ()
        self._follow_every = Every(netns.NETNS_EVERY)
        self._history: collections.deque[tuple[float, dict[int, tuple[int, int, int, int]]]] = \
            collections.deque(maxlen=64)
        # What each tick needs from the config, worked out once per start or reload rather than every 100 ms.
        self.specs: dict[str, Any] = {}
        self.table: dict[int, TenantInfo] = {}

    @staticmethod
    def _derive(cfg: Config) -> tuple[dict[str, Any], dict[int, TenantInfo]]:
        try:
            table = tenant_table(cfg)
        except ValueError as e:
            raise CapabilityError(str(e)) from None
        return baseline(cfg), {tid: info for tid, info in table.items() if tid != UNMATCHED_ID}

    def probe(self, features: "Features") -> Verdict:
        if os.geteuid() != 0:
            return Verdict(State.UNAVAILABLE, "needs root (CAP_BPF, CAP_NET_ADMIN)")
        if not features.kernel_headers:
            return Verdict(State.UNAVAILABLE, "no kernel headers for BCC (run make setup)")
        if not (features.clsact and features.cls_bpf):
            return Verdict(State.UNAVAILABLE, "the kernel lacks clsact or cls_bpf")
        if features.bpffs == "absent":
            return Verdict(State.UNAVAILABLE, "no bpffs to pin maps in (fail-static needs it)")
        names = interfaces(self.ctx.config, self.ctx.hostfs)
        notes = []
        q = self.ctx.config.quota
        try:
            with tc.IPRoute() as ipr:
                for n in names:
                    idx = tc.ifindex(ipr, n)
                    if idx is None:
                        return Verdict(State.UNAVAILABLE, f"interface {n!r} not found")
                    for h in tc.ingress_filters(ipr, idx, n):
                        if not tc.is_ours(h, q.tc_prio, q.tc_handle):
                            notes.append(f"other filter: {h}")
                    notes += [f"runs before ours: {p}" for p in tc.tcx_programs(n)]
        except OSError as e:
            return Verdict(State.UNAVAILABLE, f"cannot list tc filters: {e}")
        reason = f"ingress of {', '.join(names)}"
        if any(t.match.pods for t in self.ctx.config.tenants):
            try:
                grpc_module()
            except CriError as e:
                return Verdict(State.UNAVAILABLE, str(e))
            # A runtime not answering now (restarting with the node) is no reason to leave every tenant
            # unenforced: quota runs, and the pods' namespaces get their tenants once it answers (check fails).
            runtime: list[str] = []
            problem = pods_service.problem(self.ctx.config, self.ctx.hostfs, runtime)
            reason += f"; pods from {runtime[0]}" if runtime else f"; {problem}: no pods tenant until one answers"
        if q.namespaces:
            reason += "; serving network namespaces followed (egress of their host-side veths)"
        if notes:
            reason += "; " + "; ".join(notes)
        return Verdict(State.ACTIVE, reason, tuple(notes))

    def start(self, plan: tuple[str, ...]) -> None:
        """plan: the other filters and programs probe found on the hooks, which status names."""
        cfg = self.ctx.config
        self.others = list(plan)
        self.specs, self.table = self._derive(cfg)
        try:
            self.datapath = dp.Datapath(cfg)
            self.datapath.write_config(cfg, _baseline_buckets(cfg))
            self.attached = interfaces(cfg, self.ctx.hostfs)
            for line in self.datapath.attach(self.attached):
                log.info("%s", line)
            self._follow(starting=True)
        except Exception as e:  # noqa: BLE001 - bcc, netlink and bpf() all raise their own kinds
            self._failed_start()
            raise CapabilityError(f"cannot load or attach the classifier: {e}") from e
        if self.datapath.adopted:
            log.info("adopted pinned quota state at %s", self.datapath.path)
        self.ctx.services["quota.limits"] = LimitsWriter(self)
        self.ctx.services["quota.fleet"] = FleetWriter(self)

    def maintain(self) -> None:
        # Every tick: adaptive limits hold in the kernel only while this is younger than quota.heartbeat_timeout.
        assert self.datapath is not None
        self.datapath.heartbeat()
        # Serving network namespaces come and go (pods): followed on their own schedule, not by a restart.
        if self._follow_every.due(self.ctx.clock()):
            self._follow()

    def collect(self) -> QuotaPart:
        d = self.datapath
        assert d is not None
        r = d.read()
        now = r.ktime_ns / 1e9
        self._history.append((now, dict(r.counts)))
        old_t, old = self._history[0]
        for t, c in self._history:
            if now - t >= 1.0:
                old_t, old = t, c
        span = now - old_t
        cfg = self.ctx.config
        specs = self.specs
        fresh = r.ktime_ns - r.heartbeat_ns <= int(cfg.quota.heartbeat_timeout * 1e9)
        tenants = {}
        for tid, info in self.table.items():
            c = r.counts.get(tid, (0, 0, 0, 0))
            o = old.get(tid, (0, 0, 0, 0))
            spec = specs.get(info.name)
            base = spec.requests if spec else None
            lim_in_force = base
            ovr = self.overrides.get(info.name)
            if ovr is not None and fresh:
                lim_in_force = with_floor(ovr, spec.floor if spec else None)
            share = self.fleet.get(info.name)
            on_share = share is not None and fresh and r.ktime_ns < share[1] and \
                (lim_in_force is None or share[0].rps < lim_in_force.rps)
            if on_share:
                lim_in_force = share[0]
            tokens = None
            kl = r.limits.get(tid)
            if kl is not None and lim_in_force is not None:
                b = kl.fleet if on_share else kl.override if (ovr is not None and fresh) else kl.req
                tat = r.buckets.get(tid, (0, 0))[0]
                if b.interval_ns:
                    tokens = max(0.0, (b.tau_ns - max(tat - r.ktime_ns, 0)) / b.interval_ns)
            tenants[info.name] = TenantQuota(
                tenant=info.name, tier=info.tier, baseline=base, limit=lim_in_force,
                admitted=c[0], dropped=c[1], conn_admitted=c[2], conn_dropped=c[3],
                admitted_rps=(c[0] - o[0]) / span if span > 0 else 0.0,
                dropped_rps=(c[1] - o[1]) / span if span > 0 else 0.0, bucket_tokens=tokens)
        return QuotaPart(tenants=tenants, unmatched_packets=r.stats.get("unmatched", 0),
                         unmatched_counts=r.counts.get(UNMATCHED_ID, (0, 0, 0, 0)), passed=dict(r.stats),
                         interfaces=tuple(self.attached), pins=d.path, others_on_hook=tuple(self.others),
                         namespaces=self.followed)

    def _follow(self, starting: bool = False) -> None:
        d = self.datapath
        assert d is not None
        cfg = self.ctx.config
        rules = netns.ns_rules(cfg.tenants)
        pods = self.ctx.service(Pods)
        pods.current(any(r.by_pod for r in rules), cfg.pods, starting)
        found: dict[int, netns.ServingNs] = {}
        veths: dict[int, list[tuple[int, str]]] = {}
        if cfg.quota.namespaces:
            found = self.ctx.service(netns.Follower).current(
                cfg.tracked_ports(), any(not r.by_pod for r in rules), self.ctx.clock())
            classified = set(cfg.watched_ports())
            found = {ino: ns for ino, ns in found.items() if ns.ports & classified}
            with tc.IPRoute() as ipr:
                veths = {ino: v for ino, ns in found.items() if (v := netns.host_veths(ipr, self.ctx.hostfs, ns))}
        pod = {ino: pods.pod_of(found[ino]) for ino in veths}
        tenants = {ino: netns.namespace_tenants(rules, found[ino], pod[ino]) for ino in veths}
        entries = {(idx, port): tid for ino, vs in veths.items() for idx, _ in vs
                   for port, tid in tenants[ino].items()}
        d.set_netns(entries)
        for line in d.attach(self.attached, [name for vs in veths.values() for _, name in vs]):
            log.info("%s", line)
        names = {tid: info.name for tid, info in self.table.items()}
        before = {n["netns"]: n["tenants"] for n in self.followed}
        shown = {ino: {str(p or "any"): names.get(t, str(t)) for p, t in tenants[ino].items()} for ino in veths}
        for ino in veths.keys() - self.egress.keys():
            ns = found[ino]
            log.info("following network namespace %d (pid %d, ports %s%s) through %s%s", ino, ns.pid,
                     ",".join(map(str, sorted(ns.ports))), f", pod {pod[ino].ref}" if pod[ino] else "",
                     ", ".join(n for _, n in veths[ino]), "".join(f"; port {p}: tenant {t}"
                                                                  for p, t in shown[ino].items()))
        for ino in veths.keys() & self.egress.keys():
            if before.get(ino) != shown[ino]:  # its pod became known, or unknown, or changed its labels
                log.info("network namespace %d%s: tenants now %s", ino,
                         f" (pod {pod[ino].ref})" if pod[ino] else "",
                         ", ".join(f"port {p}: {t}" for p, t in shown[ino].items()) or "by port and CIDR")
        for ino in self.egress.keys() - veths.keys():
            log.info("network namespace %d no longer serves here (gone, or its veth is): its rules removed", ino)
        self.egress = veths
        # As status shows them: worked out here, when they change, not in every tick's collect.
        self.followed = tuple({
            "netns": ino, "pid": found[ino].pid, "ports": sorted(found[ino].ports),
            "egress": [n for _, n in vs], "pod": pod[ino].ref if pod[ino] else None, "tenants": shown[ino],
        } for ino, vs in sorted(veths.items()))

    def prepare(self, config: Config) -> Change:
        d = self.datapath
        if d is None:
            return UNCHANGED
        names = interfaces(config, self.ctx.hostfs)
        try:
            with tc.IPRoute() as ipr:
                missing = [n for n in names if tc.ifindex(ipr, n) is None]
        except OSError as e:
            raise CapabilityError(f"cannot list interfaces: {e}") from e
        if missing:
            raise CapabilityError(f"interface(s) not found: {', '.join(missing)}")
        new = _Written(config, names, self._derive(config),
                       {n: v for n, v in self.overrides.items() if n in {t.name for t in config.tenants}})
        old = _Written(self.ctx.config, self.attached, (self.specs, self.table), self.overrides)
        return rewrite(self._write, new, old, "quota maps")

    def _write(self, w: "_Written") -> None:
        d = self.datapath
        assert d is not None
        d.write_config(w.config, _baseline_buckets(w.config))
        d.set_overrides({tenant_id(n): bucket(v.rps, v.burst) for n, v in w.overrides.items()})
        for line in d.attach(w.interfaces, [n for vs in self.egress.values() for _, n in vs]):
            log.info("%s", line)
        self.attached = list(w.interfaces)
        self.specs, self.table = w.derived
        self.overrides = dict(w.overrides)
        self._follow_every.again()  # process rules may have changed: the next tick follows afresh

    def _failed_start(self) -> None:
        """A start that failed leaves what it adopted enforcing (the previous agent's limits hold); a datapath of
        its own that never enforced anything goes."""
        d, self.datapath = self.datapath, None
        if d is None:
            return
        d.close()
        if not d.adopted and not d.older:
            q = self.ctx.config.quota
            for line in dp.remove_attachments(d.path, q.tc_prio, q.tc_handle, self.attached) + dp.remove_pins(d.path):
                log.info("%s", line)

    def stop(self) -> None:
        """A clean stop hands over: the filter keeps the program and the pins keep the limits, so the next agent
        adopts them with no moment unenforced (adaptive overrides expire with the heartbeat). With
        ctx.detach_on_exit it removes everything instead."""
        d = self.datapath
        if d is None:
            return
        self.datapath = None
        self.ctx.services.pop("quota.limits", None)
        self.ctx.services.pop("quota.fleet", None)
        q = self.ctx.config.quota
        path = d.path
        d.close()
        if not self.ctx.detach_on_exit:
            log.info("handover: filter on %s and pins at %s stay enforcing for the next agent "
                     "(qosagent detach removes them)", ", ".join(self.attached), path)
            return
        for line in dp.remove_attachments(path, q.tc_prio, q.tc_handle, self.attached) + dp.remove_pins(path):
            log.info("%s", line)

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        """What a dead agent left: ours and what an agent of another layout left (an upgrade that never started)."""
        cfg = ctx.config
        names = list(cfg.quota.interfaces) or ["lo"]
        done = []
        # Ours last: removing the last pin directory removes the pin root too.
        for path in [*dp.other_layouts(cfg.bpf.pin_root), dp.pin_dir(cfg)]:
            done += dp.remove_attachments(path, cfg.quota.tc_prio, cfg.quota.tc_handle, names) + dp.remove_pins(path)
        return done

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot) -> Iterable["Metric"]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        part = snapshot.part("quota")
        if not isinstance(part, QuotaPart):
            return
        req = CounterMetricFamily("qosagent_quota_requests", "New HTTP/1.x requests (request-start segments) by "
                                  "verdict", labels=["tenant", "tier", "verdict"])
        conn = CounterMetricFamily("qosagent_quota_connections", "New connections (SYN) by verdict",
                                   labels=["tenant", "tier", "verdict"])
        limit = GaugeMetricFamily("qosagent_quota_limit_rps", "Request-start rate limit in force (baseline or an "
                                  "adaptive override while the heartbeat is fresh, or the node's fleet share where "
                                  "lower)", labels=["tenant", "tier"])
        base = GaugeMetricFamily("qosagent_quota_baseline_rps", "Configured request-start rate limit",
                                 labels=["tenant", "tier"])
        tokens = GaugeMetricFamily("qosagent_quota_bucket_tokens", "Request tokens left in the tenant's bucket",
                                   labels=["tenant", "tier"])
        for t in part.tenants.values():
            req.add_metric([t.tenant, t.tier, "admitted"], t.admitted)
            req.add_metric([t.tenant, t.tier, "dropped"], t.dropped)
            conn.add_metric([t.tenant, t.tier, "admitted"], t.conn_admitted)
            conn.add_metric([t.tenant, t.tier, "dropped"], t.conn_dropped)
            if t.limit is not None:
                limit.add_metric([t.tenant, t.tier], t.limit.rps)
            if t.baseline is not None:
                base.add_metric([t.tenant, t.tier], t.baseline.rps)
            if t.bucket_tokens is not None:
                tokens.add_metric([t.tenant, t.tier], t.bucket_tokens)
        um = part.unmatched_counts
        req.add_metric([UNMATCHED, "none", "admitted"], um[0])
        conn.add_metric([UNMATCHED, "none", "admitted"], um[2])
        yield from (req, conn, limit, base, tokens)
        passed = CounterMetricFamily("qosagent_quota_passed_packets", "Packets passed without a quota check, by "
                                     "reason (unmatched: new connections and requests of no tenant)",
                                     labels=["reason"])
        for reason, n in sorted(part.passed.items()):
            passed.add_metric([reason], n)
        yield passed

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part("quota")
        if not isinstance(part, QuotaPart):
            return {}

        def lim(x: TenantLimit | None) -> Any:
            return None if x is None else {"rps": x.rps, "burst": x.burst}

        return {
            "interfaces": list(part.interfaces),
            "namespaces": [dict(n) for n in part.namespaces],
            "pins": part.pins,
            "others_on_hook": list(part.others_on_hook),
            "unmatched_packets": part.unmatched_packets,
            "passed": dict(part.passed),
            "tenants": [{
                "tenant": t.tenant, "tier": t.tier, "limit": lim(t.limit), "baseline": lim(t.baseline),
                "admitted": t.admitted, "dropped": t.dropped, "conn_admitted": t.conn_admitted,
                "conn_dropped": t.conn_dropped, "admitted_rps": t.admitted_rps, "dropped_rps": t.dropped_rps,
                "bucket_tokens": t.bucket_tokens,
            } for t in part.tenants.values()],
        }

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        def lim(x: Any) -> str:
            return "-" if not x else f"{x['rps']:g}/{x['burst']}"

        lines = [f"QUOTA on {', '.join(status.get('interfaces') or [])}  pins {status.get('pins')}  "
                 f"unmatched packets {status.get('unmatched_packets', 0)}"]
        for o in status.get("others_on_hook") or []:
            lines.append(f"  {o}")
        for n in status.get("namespaces") or []:
            who = ", ".join(f"port {p}: {t}" for p, t in n["tenants"].items()) or "tenants by port and CIDR"
            pod = f", pod {n['pod']}" if n.get("pod") else ""
            lines.append(f"  netns {n['netns']} (pid {n['pid']}, ports {','.join(map(str, n['ports']))}{pod}) "
                         f"egress of {', '.join(n['egress'])}: {who}")
        lines.append(f"{'TENANT':<16} {'TIER':<8} {'LIMIT':>10} {'BASELINE':>10} {'ADMIT/S':>8} {'DROP/S':>8} "
                     f"{'ADMITTED':>9} {'DROPPED':>8} {'CONN_ADM':>8} {'CONN_DROP':>9} {'TOKENS':>7}")
        for t in status.get("tenants", []):
            tok = "-" if t.get("bucket_tokens") is None else f"{t['bucket_tokens']:.1f}"
            lines.append(f"{t['tenant']:<16} {t['tier']:<8} {lim(t['limit']):>10} {lim(t['baseline']):>10} "
                         f"{t['admitted_rps']:>8.1f} {t['dropped_rps']:>8.1f} {t['admitted']:>9} {t['dropped']:>8} "
                         f"{t['conn_admitted']:>8} {t['conn_dropped']:>9} {tok:>7}")
        return "\n".join(lines)
