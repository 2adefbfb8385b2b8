"""The tick's read of the quota maps (datapath.Reading) as the part: each tenant's counts, its rates over the
last second, the limit in force (the configured one; admission's override while the heartbeat is fresh; the fleet's
share while its lease lasts, where it is lower) and the tokens left in that limit's bucket. No map is read here; the
only state is the Tenants view's (the rates, the rows built, and the part last published, which part() records so a
tick at rest can hand it on)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.rowmap import RowMap
from qosagent.tenants import UNMATCHED_ID, TenantInfo, TenantLimit, TenantQuotaSpec, with_floor
from qosagent.window import Windows

if TYPE_CHECKING:
    from qosagent.quota.datapath import Reading

_NONE = (0, 0, 0, 0)


class Tenants:
    """Each tenant's counts (admitted, dropped, connections admitted, dropped) since the maps were created and a second
    ago for the rates (by the kernel's clock), advanced only for tenants whose counts moved (qosagent/window.py), and
    the part's TenantQuota of each, rebuilt only where it can have changed: the counts read this tick, a rate over the
    last second or a bucket refilling (both move with time), an override or a fleet share (their holding moves with
    the heartbeat and the lease), and every tenant after a start, a reload, or a change of those."""

    def __init__(self) -> None:
        self._rates: Windows[int, tuple[int, int, int, int]] = Windows(1.0, _NONE)
        self._buckets: dict[int, tuple[int, int]] = {}  # tenant id -> (req_tat, conn_tat) as last read
        self._built: dict[int, TenantQuota] = {}
        self._moving: set[int] = set()
        self._seen: tuple[Any, ...] | None = None
        self.tenants: RowMap[str, TenantQuota] = RowMap()  # by name; each part holds its tick's version, shared
        self.version = 0  # moves whenever tenants or the unmatched tenant's counts do: the part is made again
        # The last update changed a configured tenant's row: what decisions read (the unmatched tenant's counts,
        # traffic on the watched ports that no tenant claims, such as the agent's own reads of a server's metrics,
        # are reported only).
        self.rows_moved = True
        self.published: tuple[int, QuotaPart] | None = None  # the last part made, and the version it was made at

    @property
    def still(self) -> bool:
        """No tenant's row moves with time alone: no rate over the last second above 0, no bucket refilling, no
        override or fleet share held."""
        return not self._moving

    def counts(self, tid: int) -> tuple[int, int, int, int]:
        return self._rates.current(tid)

    def update(self, r: "Reading", table: Mapping[int, TenantInfo], specs: Mapping[str, TenantQuotaSpec],
               overrides: Mapping[str, TenantLimit], fleet: Mapping[str, tuple[TenantLimit, int]],
               heartbeat_timeout: float) -> None:
        """This tick's read, of the tenants of table under the limits in force: specs configured, overrides by
        admission, fleet shares with their lease's end (kernel ns)."""
        rates = self._rates
        moved = rates.tick(r.ktime_ns / 1e9, r.counts)
        self._buckets.update(r.buckets)
        span = r.ktime_ns / 1e9 - rates.start
        fresh = r.ktime_ns - r.heartbeat_ns <= int(heartbeat_timeout * 1e9)
        seen = (table, specs, fresh, dict(overrides), dict(fleet))
        last = self._seen
        everything = last is None or last[0] is not table or last[1] is not specs or last[2:] != seen[2:]
        self._seen = seen
        if everything:
            old, self._built, rebuild = self._built, {}, list(table)
        else:
            old, rebuild = self._built, list((set(r.counts) | moved | self._moving) & table.keys())
        changed = everything or UNMATCHED_ID in r.counts or UNMATCHED_ID in moved
        differ: dict[str, TenantQuota] = {}  # the rows worked out again and not equal to those they replace
        for tid in rebuild:
            info = table[tid]
            t = _tenant(r, info, rates.current(tid), rates.base(tid), self._buckets.get(tid), span, fresh,
                        specs.get(info.name), overrides.get(info.name), fleet.get(info.name))
            was = old.get(tid)
            if was == t:
                t = was  # read again, the same: the part made from it may be handed on
            else:
                changed, differ[t.tenant] = True, t
            self._built[tid] = t
            refilling = t.bucket_tokens is not None and self._buckets.get(tid, (0, 0))[0] > r.ktime_ns
            if t.admitted_rps or t.dropped_rps or refilling or info.name in overrides or info.name in fleet:
                self._moving.add(tid)
            else:
                self._moving.discard(tid)
        self.rows_moved = everything or bool(differ)
        if not changed:
            return
        self.version += 1
        if everything:
            self.tenants = RowMap({t.tenant: t for t in self._built.values()})
        else:  # the next version: the rows that differ since its base are copied, the others shared (RowMap.replace)
            self.tenants = self.tenants.replace(differ)


def _tenant(r: "Reading", info: TenantInfo, c: tuple[int, int, int, int], o: tuple[int, int, int, int],
            bucket: tuple[int, int] | None, span: float, fresh: bool, spec: TenantQuotaSpec | None,
            ovr: TenantLimit | None, share: tuple[TenantLimit, int] | None) -> TenantQuota:
    """One tenant: its counts now (c) and span seconds ago (o), under the limit in force."""
    base = spec.requests if spec else None
    lim_in_force = base
    if ovr is not None and fresh:
        lim_in_force = with_floor(ovr, spec.floor if spec else None)
    on_share = share is not None and fresh and r.ktime_ns < share[1] and \
        (lim_in_force is None or share[0].rps < lim_in_force.rps)
    if on_share:
        assert share is not None
        lim_in_force = share[0]
    tokens = None
    kl = r.limits.get(info.id)
    if kl is not None and lim_in_force is not None:
        b = kl.fleet if on_share else kl.override if (ovr is not None and fresh) else kl.req
        tat = (bucket or (0, 0))[0]
        if b.interval_ns:
            tokens = max(0.0, (b.tau_ns - max(tat - r.ktime_ns, 0)) / b.interval_ns)
    return TenantQuota(
        tenant=info.name, tier=info.tier, baseline=base, limit=lim_in_force,
        admitted=c[0], dropped=c[1], conn_admitted=c[2], conn_dropped=c[3],
        admitted_rps=(c[0] - o[0]) / span if span > 0 else 0.0,
        dropped_rps=(c[1] - o[1]) / span if span > 0 else 0.0, bucket_tokens=tokens)


def part(r: "Reading", view: Tenants, interfaces: tuple[str, ...], pins: str, others_on_hook: tuple[str, ...],
         namespaces: tuple[Mapping[str, Any], ...]) -> QuotaPart:
    """The part: tenants, the unmatched traffic's counts and what passed unchecked, from r and view; where the
    classifier sits, as the capability has it. The part made last is handed on when nothing in it would differ: a
    tick at rest copies no tenant's row, and one that changes some copies the rows changed since the RowMap's base,
    folding them into a new base once they are more than an eighth of the rows (RowMap.replace)."""
    if view.published is not None:
        version, last = view.published
        if version == view.version and last.rows_read == r.rows_read and last.passed == r.stats \
                and last.interfaces == interfaces and last.pins == pins and last.others_on_hook == others_on_hook \
                and last.namespaces == namespaces:
            return last
    made = QuotaPart(tenants=view.tenants, unmatched_packets=r.stats.get("unmatched", 0),
                     unmatched_counts=view.counts(UNMATCHED_ID), passed=dict(r.stats), interfaces=interfaces,
                     pins=pins, others_on_hook=others_on_hook, namespaces=namespaces, rows_read=r.rows_read)
    view.published = (view.version, made)
    return made
