"""What quota shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from qosagent.config import UNMATCHED
from qosagent.quota.model import QuotaPart
from qosagent.tenants import TenantLimit


def metrics(part: QuotaPart) -> Iterable[Metric]:
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
                                 "reason (unmatched: new connections and requests of no tenant)", labels=["reason"])
    for reason, n in sorted(part.passed.items()):
        passed.add_metric([reason], n)
    yield passed


def status(part: QuotaPart) -> dict[str, Any]:
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
