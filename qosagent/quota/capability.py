"""Per-tenant quotas in the kernel: the quota capability's face (probe, start, collect, prepare, stop, detach),
wiring its datapath, where it sits (interfaces.py), the limits writer offered to admission (limits.py) and what it
shows (export.py)."""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from qosagent.capability import UNCHANGED, AgentContext, Capability, CapabilityError, Change, State, Verdict, rewrite
from qosagent.config import Config
from qosagent import netns
from qosagent.pods import service as pods_service
from qosagent.pods.cri import CriError, grpc_module
from qosagent.pods.service import Pods
from qosagent.quota import datapath as dp
from qosagent.quota import export, tc
from qosagent.quota.interfaces import NamespaceEgress, interfaces
from qosagent.quota.limits import FleetWriter, LimitsWriter
from qosagent.quota.model import QUOTA, QuotaPart, TenantQuota
from qosagent.quota.rules import baseline_buckets, bucket
from qosagent.snapshot import Snapshot
from qosagent.tenants import (
    FLEET_SERVICE,
    LIMITS_SERVICE,
    UNMATCHED_ID,
    TenantInfo,
    TenantLimit,
    baseline,
    tenant_id,
    tenant_table,
    with_floor,
)

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.features import Features

log = logging.getLogger("qosagent.quota")


@dataclass(frozen=True)
class _Written:
    """What a config makes of the datapath: kept for the old config too, so a reload can be undone."""

    config: Config
    interfaces: list[str]
    derived: tuple[dict[str, Any], dict[int, TenantInfo]]
    overrides: dict[str, TenantLimit]


class Quota(Capability):
    name = "quota"
    uses = (netns.Follower, Pods)
    offers = (LIMITS_SERVICE, FLEET_SERVICE)
    loads_bpf = True

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.datapath: dp.Datapath | None = None
        self.overrides: dict[str, TenantLimit] = {}
        self.fleet: dict[str, tuple[TenantLimit, int]] = {}  # tenant -> fleet share, end of its lease (ktime ns)
        self.attached: list[str] = []
        self.others: list[str] = []
        self.namespaces = NamespaceEgress(ctx)
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
            self.datapath.write_config(cfg, baseline_buckets(cfg))
            self.attached = interfaces(cfg, self.ctx.hostfs)
            for line in self.datapath.attach(self.attached):
                log.info("%s", line)
            self._follow(starting=True)
        except Exception as e:  # noqa: BLE001 - bcc, netlink and bpf() all raise their own kinds
            self._failed_start()
            raise CapabilityError(f"cannot load or attach the classifier: {e}") from e
        if self.datapath.adopted:
            log.info("adopted pinned quota state at %s", self.datapath.path)
        self.ctx.services[LIMITS_SERVICE] = LimitsWriter(self)
        self.ctx.services[FLEET_SERVICE] = FleetWriter(self)

    def maintain(self) -> None:
        # Every tick: adaptive limits hold in the kernel only while this is younger than quota.heartbeat_timeout.
        assert self.datapath is not None
        self.datapath.heartbeat()
        # Serving network namespaces come and go (pods): followed on their own schedule, not by a restart.
        if self.namespaces.every.due(self.ctx.clock()):
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
                         namespaces=self.namespaces.shown)

    def _follow(self, starting: bool = False) -> None:
        assert self.datapath is not None
        self.namespaces.follow(self.datapath, self.attached, self.table, starting)

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
        d.write_config(w.config, baseline_buckets(w.config))
        d.set_overrides({tenant_id(n): bucket(v.rps, v.burst) for n, v in w.overrides.items()})
        for line in d.attach(w.interfaces, self.namespaces.names()):
            log.info("%s", line)
        self.attached = list(w.interfaces)
        self.specs, self.table = w.derived
        self.overrides = dict(w.overrides)
        self.namespaces.every.again()  # process rules may have changed: the next tick follows afresh

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
        self.ctx.services.pop(LIMITS_SERVICE, None)
        self.ctx.services.pop(FLEET_SERVICE, None)
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
        part = snapshot.part(QUOTA)
        return export.metrics(part) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(QUOTA)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)
