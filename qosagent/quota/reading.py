"""The tick's read of the quota maps (datapath.Reading) as the part, pure: each tenant's counts, its rates over the
last second, the limit in force (the configured one; admission's override while the heartbeat is fresh; the fleet's
share while its lease lasts, where it is lower) and the tokens left in that limit's bucket."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Mapping

from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.tenants import UNMATCHED_ID, TenantInfo, TenantLimit, TenantQuotaSpec, with_floor

if TYPE_CHECKING:
    from qosagent.quota.datapath import Reading

Counts = Mapping[int, tuple[int, int, int, int]]
_NONE = (0, 0, 0, 0)


class Rates:
    """The counts of the last reads (by the kernel's clock), so that a rate spans about a second."""

    def __init__(self) -> None:
        self._history: collections.deque[tuple[float, Counts]] = collections.deque(maxlen=64)

    def push(self, now: float, counts: Counts) -> tuple[float, Counts]:
        """Record counts read at now; the (time, counts) to take rates against: the newest read at least a second
        old, else the oldest kept."""
        self._history.append((now, dict(counts)))
        old_t, old = self._history[0]
        for t, c in self._history:
            if now - t >= 1.0:
                old_t, old = t, c
        return old_t, old


def tenants(r: "Reading", old_t: float, old: Counts, table: Mapping[int, TenantInfo],
            specs: Mapping[str, TenantQuotaSpec], overrides: Mapping[str, TenantLimit],
            fleet: Mapping[str, tuple[TenantLimit, int]], heartbeat_timeout: float) -> dict[str, TenantQuota]:
    """Each tenant of table (its counts then, old, at old_t) under the limits in force: specs configured, overrides
    by admission, fleet shares with their lease's end (kernel ns)."""
    span = r.ktime_ns / 1e9 - old_t
    fresh = r.ktime_ns - r.heartbeat_ns <= int(heartbeat_timeout * 1e9)
    out = {}
    for tid, info in table.items():
        c = r.counts.get(tid, _NONE)
        o = old.get(tid, _NONE)
        spec = specs.get(info.name)
        base = spec.requests if spec else None
        lim_in_force = base
        ovr = overrides.get(info.name)
        if ovr is not None and fresh:
            lim_in_force = with_floor(ovr, spec.floor if spec else None)
        share = fleet.get(info.name)
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
        out[info.name] = TenantQuota(
            tenant=info.name, tier=info.tier, baseline=base, limit=lim_in_force,
            admitted=c[0], dropped=c[1], conn_admitted=c[2], conn_dropped=c[3],
            admitted_rps=(c[0] - o[0]) / span if span > 0 else 0.0,
            dropped_rps=(c[1] - o[1]) / span if span > 0 else 0.0, bucket_tokens=tokens)
    return out


def part(r: "Reading", tenants: Mapping[str, TenantQuota], interfaces: tuple[str, ...], pins: str,
         others_on_hook: tuple[str, ...], namespaces: tuple[Mapping[str, Any], ...]) -> QuotaPart:
    """The part: tenants, the unmatched traffic's counts and what passed unchecked, from r; where the classifier
    sits, as the capability has it."""
    return QuotaPart(tenants=tenants, unmatched_packets=r.stats.get("unmatched", 0),
                     unmatched_counts=r.counts.get(UNMATCHED_ID, _NONE), passed=dict(r.stats), interfaces=interfaces,
                     pins=pins, others_on_hook=others_on_hook, namespaces=namespaces)
