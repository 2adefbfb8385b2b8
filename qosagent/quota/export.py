"""What quota shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable

from prometheus_client.core import Metric

from qosagent.capability import Attention
from qosagent.config import UNMATCHED
from qosagent.exposition import Family, Series, families
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.retention import EVERYONE
from qosagent.tenants import TenantLimit

VERDICT = ("tenant", "tier", "verdict")
TENANT = ("tenant", "tier")


@dataclass(frozen=True)
class Source:
    """The part, and the tenants whose series are written (metrics.retention)."""

    part: QuotaPart
    shown: Container[str] = EVERYONE

    @property
    def rows(self) -> Iterable[TenantQuota]:
        return (t for t in self.part.tenants.values() if t.tenant in self.shown)


def _verdicts(admitted: Callable[[TenantQuota], int], dropped: Callable[[TenantQuota], int],
              unmatched: int) -> Callable[[Source], Series]:
    """Admitted and dropped per tenant shown, then the unmatched tenant's admitted (never limited, still counted;
    unmatched: its index in QuotaPart.unmatched_counts)."""
    def series(s: Source) -> Series:
        for t in s.rows:
            yield [t.tenant, t.tier, "admitted"], admitted(t)
            yield [t.tenant, t.tier, "dropped"], dropped(t)
        yield [UNMATCHED, "none", "admitted"], s.part.unmatched_counts[unmatched]
    return series


def _rates(value: Callable[[TenantQuota], float | None]) -> Callable[[Source], Series]:
    """Per tenant shown, where it has the value (a limit, a bucket)."""
    return lambda s: (([t.tenant, t.tier], v) for t in s.rows if (v := value(t)) is not None)


FAMILIES: tuple[Family[Source], ...] = (
    Family("qosagent_quota_requests", "counter", "New HTTP/1.x requests (request-start segments) by verdict",
           VERDICT, _verdicts(lambda t: t.admitted, lambda t: t.dropped, 0)),
    Family("qosagent_quota_connections", "counter", "New connections (SYN) by verdict", VERDICT,
           _verdicts(lambda t: t.conn_admitted, lambda t: t.conn_dropped, 2)),
    Family("qosagent_quota_limit_rps", "gauge", "Request-start rate limit in force (baseline or an adaptive "
           "override while the heartbeat is fresh, or the node's fleet share where lower)", TENANT,
           _rates(lambda t: None if t.limit is None else t.limit.rps)),
    Family("qosagent_quota_baseline_rps", "gauge", "Configured request-start rate limit", TENANT,
           _rates(lambda t: None if t.baseline is None else t.baseline.rps)),
    Family("qosagent_quota_bucket_tokens", "gauge", "Request tokens left in the tenant's bucket", TENANT,
           _rates(lambda t: t.bucket_tokens)),
    Family("qosagent_quota_passed_packets", "counter", "Packets passed without a quota check, by reason "
           "(unmatched: new connections and requests of no tenant)", ("reason",),
           lambda s: (([reason], n) for reason, n in sorted(s.part.passed.items()))),
)


def metrics(part: QuotaPart, shown: Container[str] = EVERYONE) -> Iterable[Metric]:
    return families(FAMILIES, Source(part, shown))


def traffic(part: QuotaPart) -> dict[str, tuple[int, ...]]:
    """Per tenant, its request starts and connections, admitted and dropped."""
    return {t.tenant: (t.admitted, t.dropped, t.conn_admitted, t.conn_dropped) for t in part.tenants.values()}


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


def attention(st: dict[str, Any]) -> dict[str, Attention]:
    """Per tenant: throttled while its requests are dropped, and its request starts per second."""
    return {t["tenant"]: Attention(throttled=t.get("dropped_rps", 0) > 0,
                                   rps=t.get("admitted_rps", 0) + t.get("dropped_rps", 0))
            for t in st.get("tenants", [])}


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
