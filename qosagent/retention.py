"""Which tenants' series a scrape writes: those with traffic within metrics.retention.

A node may serve a thousand tenants of which a few send anything; every per-tenant series of the others would be
written on every scrape, unchanged, and dominate it (issue 26: 70 MB for 1,000 tenants). A tenant idle past the
retention window leaves the exposition (Prometheus marks its series stale) and comes back, with its counts since
start, when it has traffic again.
"""

from __future__ import annotations

from typing import Container, Mapping


class _Everyone:
    def __contains__(self, _tenant: object) -> bool:
        return True


EVERYONE: Container[str] = _Everyone()  # every tenant's series (no capability says who has traffic)


class Retention:
    """Which tenants have had traffic within `window` seconds (metrics.retention), from what each capability counts
    of their traffic (Capability.traffic: per tenant, counts that grow with it). Counts that differ from the last
    ones seen mark the tenant active at that time; a tenant first seen is active then if it has counted anything
    (since start, when is unknown), else not until its counts move.

    Fed once per exposition built (a snapshot scraped), so the time of a change is known to within a scrape
    interval, which is far below the window."""

    def __init__(self, window: float):
        self.window = window
        self._seen: dict[tuple[str, str], object] = {}  # (capability, tenant) -> its last counts
        self._active: dict[str, float] = {}  # tenant -> when its traffic was last seen to change

    def shown(self, now: float, traffic: Mapping[str, Mapping[str, tuple[int, ...]]]) -> Container[str]:
        """The tenants whose series a scrape at `now` writes. traffic: capability -> tenant -> its counts.
        EVERYONE while no capability reports any tenant's traffic."""
        if not any(traffic.values()):
            return EVERYONE
        seen_now = {key: v for key, v in self._seen.items() if key[0] not in traffic}  # a part missing this tick
        for cap, tenants in traffic.items():
            for tenant, counts in tenants.items():
                before = self._seen.get((cap, tenant), _UNSEEN)
                seen_now[cap, tenant] = counts
                if before != counts and (before is not _UNSEEN or any(counts)):
                    self._active[tenant] = now
        self._seen = seen_now  # tenants no longer configured are forgotten
        horizon = now - self.window
        self._active = {t: at for t, at in self._active.items() if at >= horizon}
        return frozenset(self._active)


_UNSEEN = object()

