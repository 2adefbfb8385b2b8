"""Fleet-wide tenant quotas, the agent's side: report demand, enforce this node's share (docs/fleet.md).

Each tick reads what the reporter thread last saw (collect), chooses each tenant's share (model.shares, pure),
writes the shares into the quota maps through quota's FleetWriter (a limit of its own kind: the lowest of
baseline, override and share holds, and a share ends in the kernel with its lease or the heartbeat), and hands
the reporter this tick's demand and held rates for its next report.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Container, Iterable

from qosagent.capability import Capability, CapabilityError, State, Verdict
from qosagent.retention import EVERYONE
from qosagent.fleet.agent import Reporter
from qosagent.fleet.records import Want
from qosagent.fleet.etcd import Etcd, EtcdError
from qosagent.fleet import export
from qosagent.fleet.model import FLEET, FleetPart, TenantShare, shares
from qosagent.fleet.quotas import fleet_quotas, node_burst
from qosagent.quota.model import QUOTA
from qosagent.snapshot import Decision, Snapshot
from qosagent.tenants import FLEET_NO_END, FLEET_SERVICE, FleetWriter, TenantLimit

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.features import Features



class Fleet(Capability):
    name = "fleet"

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.reporter: Reporter | None = None
        self.current: dict[str, TenantShare] = {}
        self._written: dict[str, tuple[float, str]] = {}
        self._wants: dict[str, Want] = {}

    def probe(self, features: "Features") -> Verdict:
        cfg = self.ctx.config
        f = cfg.fleet
        if not self.ctx.offered(FLEET_SERVICE):
            return Verdict(State.UNAVAILABLE, "needs the quota classifier running (fleet shares are quota limits)")
        n = len(fleet_quotas(cfg))
        reason = (f"node {f.node_name}, {n} tenant(s) with a fleet quota, etcd {', '.join(f.endpoints)}, "
                  f"safe share {f.share_when_unleased:.3g}")
        etcd = Etcd(f.endpoints)
        try:
            etcd.get(f.prefix)
        except EtcdError as e:
            # Not a reason to stay off: every node enforces its safe share until etcd answers.
            return Verdict(State.ACTIVE, f"{reason}; etcd not answering now ({e}): safe share until it does")
        finally:
            etcd.close()
        return Verdict(State.ACTIVE, reason)

    def start(self, plan: Any = None) -> None:
        if self._writer() is None:
            raise CapabilityError("the quota capability offers no fleet writer (quota not running)")
        f = self.ctx.config.fleet
        self.reporter = Reporter(f, Etcd(f.endpoints, timeout=min(1.0, f.report_interval)))
        self.reporter.start()

    def _writer(self) -> FleetWriter | None:
        return self.ctx.services.get(FLEET_SERVICE)

    def collect(self) -> FleetPart:
        assert self.reporter is not None
        return FleetPart(self.reporter.node, self.reporter.seen(), time.monotonic())

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        part = snapshot.part(FLEET)
        if part is None:
            return []
        cfg = self.ctx.config
        f = cfg.fleet
        new = shares(fleet_quotas(cfg), part.seen, part.now, f.lease, f.share_when_unleased, cfg.interval)
        out = []
        for t, s in new.items():
            old = self._written.get(t)
            # Audited when the source flips or the rate moves by 5 % of the fleet quota: not every renewal.
            if old is None or old[1] != s.source or abs(old[0] - s.node_rps) > 0.05 * s.fleet_rps:
                why = ("granted by the allocator" if s.source == "lease" else
                       "no grant yet" if part.seen.renewed_at is None else "lease ran out without a renewal")
                out.append(Decision(self.name, t, "share", None if old is None else round(old[0], 3),
                                    round(s.node_rps, 3), why, {"source": s.source, "fleet_rps": s.fleet_rps},
                                    command=s))
        self.current = new
        # The next report's wants: request starts seen (admitted + dropped, over the last second) and the share
        # enforced from now on.
        q = snapshot.part(QUOTA)
        qt = q.tenants if q is not None else {}
        self._wants = {t: Want(qt[t].admitted_rps + qt[t].dropped_rps if t in qt else 0.0, s.node_rps)
                       for t, s in new.items()}
        return out

    def apply(self, decisions: list[Decision]) -> None:
        writer, r = self._writer(), self.reporter
        if writer is None or r is None:
            return
        quotas = fleet_quotas(self.ctx.config)
        writer.set_shares({t: (TenantLimit(s.node_rps, node_burst(quotas[t], s.node_rps)),
                               FLEET_NO_END if s.until is None else int(s.until * 1e9))
                           for t, s in self.current.items()})
        self._written = {t: (s.node_rps, s.source) for t, s in self.current.items()}
        r.offer(self._wants)

    def settled(self, part: Any) -> Any:
        if not isinstance(part, FleetPart):
            return part
        return replace(part, tenants=dict(self.current))

    def stop(self) -> None:
        r, self.reporter = self.reporter, None
        if r is not None:
            r.stop()
        self.current = {}

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(FLEET)
        return export.metrics(part, shown) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(FLEET)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)
