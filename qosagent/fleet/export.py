"""What fleet shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

import dataclasses
from typing import Any, Container, Iterable

from prometheus_client.core import Metric

from qosagent.exposition import Family, families, one
from qosagent.fleet.agent import Seen
from qosagent.fleet.model import FleetPart, TenantShare
from qosagent.retention import EVERYONE


def _tenants(part: FleetPart) -> list[tuple[str, TenantShare]]:
    return sorted(part.tenants.items())


FAMILIES: tuple[Family[FleetPart], ...] = (
    Family("qosagent_fleet_share_rps", "gauge", "This node's share of the tenant's fleet quota, as enforced",
           ("tenant", "source"), lambda p: (([t, s.source], s.node_rps) for t, s in _tenants(p))),
    Family("qosagent_fleet_quota_rps", "gauge", "The tenant's fleet quota (quota.fleet_rps)", ("tenant",),
           lambda p: (([t], s.fleet_rps) for t, s in _tenants(p))),
    Family("qosagent_fleet_share_ratio", "gauge", "The part of the tenant's fleet quota this node holds "
           "(share_rps / quota_rps, 0 to 1)", ("tenant",),
           lambda p: (([t], s.node_rps / s.fleet_rps if s.fleet_rps > 0 else 0.0) for t, s in _tenants(p))),
    Family("qosagent_fleet_on_safe_share", "gauge", "1 while the tenant runs on the safe share (no live grant)",
           ("tenant",), lambda p: (([t], 1.0 if s.source == "safe" else 0.0) for t, s in _tenants(p))),
    Family("qosagent_fleet_lease_age_seconds", "gauge", "Since the tenant's grant was last renewed", ("tenant",),
           lambda p: (([t], s.lease_age_s) for t, s in _tenants(p) if s.lease_age_s is not None)),
    Family("qosagent_fleet_report_errors", "counter", "Reports to etcd that failed", (),
           one(lambda p: p.seen.report_errors)),
    Family("qosagent_fleet_reports", "counter", "Reports written to etcd", (), one(lambda p: p.seen.reports)),
    Family("qosagent_fleet_etcd_up", "gauge", "1 when the last report reached etcd", (),
           one(lambda p: 1.0 if p.seen.etcd_up else 0.0)),
    Family("qosagent_fleet_watch_up", "gauge", "1 while the watch on the round record is up (else the grant is "
           "polled)", (), one(lambda p: 1.0 if p.seen.watching else 0.0)),
    Family("qosagent_fleet_watch_breaks", "counter", "Times the watch on the round record broke or went silent",
           (), one(lambda p: p.seen.watch_breaks)),
)


def metrics(part: FleetPart, shown: Container[str] = EVERYONE) -> Iterable[Metric]:
    """Its families; a tenant's series while it is shown (metrics.retention)."""
    if shown is not EVERYONE:
        part = dataclasses.replace(part, tenants={t: s for t, s in part.tenants.items() if t in shown})
    return families(FAMILIES, part)


def status(part: FleetPart) -> dict[str, Any]:
    s: Seen = part.seen
    return {
        "node": part.node, "etcd_up": s.etcd_up, "leader": s.leader, "report_errors": s.report_errors,
        "last_error": s.last_error,
        "tenants": [{"tenant": t.tenant, "fleet_rps": t.fleet_rps, "node_rps": round(t.node_rps, 3),
                     "lease_age_s": None if t.lease_age_s is None else round(t.lease_age_s, 3),
                     "source": t.source} for t in part.tenants.values()],
    }


def render(status: dict[str, Any]) -> str:
    lines = [f"FLEET node {status.get('node')}  etcd {'up' if status.get('etcd_up') else 'DOWN'}  "
             f"leader {status.get('leader') or '-'}  report errors {status.get('report_errors', 0)}"]
    lines.append(f"{'TENANT':<16} {'FLEET_RPS':>10} {'NODE_RPS':>10} {'LEASE_AGE':>10} {'SOURCE':<6}")
    for t in status.get("tenants", []):
        age = "-" if t["lease_age_s"] is None else f"{t['lease_age_s']:.1f}s"
        lines.append(f"{t['tenant']:<16} {t['fleet_rps']:>10g} {t['node_rps']:>10.1f} {age:>10} {t['source']:<6}")
    return "\n".join(lines)

