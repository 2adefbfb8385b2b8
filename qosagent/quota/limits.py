"""The limit writers quota offers: admission's adaptive overrides (AgentContext.services["quota.limits"]), clamped
to the tier floor, and the fleet's shares (services["quota.fleet"]); both are written to the quota maps, where they
expire with the heartbeat if the agent dies (a share also at its lease's end)."""

from __future__ import annotations

import logging
from typing import Mapping, Protocol

from qosagent.quota.datapath import Datapath
from qosagent.quota.rules import Bucket, bucket
from qosagent.tenants import TenantLimit, TenantQuotaSpec, tenant_id, with_floor

log = logging.getLogger("qosagent.quota")


class Holder(Protocol):
    """What the writers read and update of the quota capability: the limits of the config in force, the overrides,
    the fleet shares and the datapath (None while stopped)."""

    specs: dict[str, TenantQuotaSpec]
    overrides: dict[str, TenantLimit]
    fleet: dict[str, tuple[TenantLimit, int]]
    datapath: Datapath | None


def override_buckets(limits: Mapping[str, TenantLimit], specs: Mapping[str, TenantQuotaSpec]) -> dict[int, Bucket]:
    """Admission's overrides as the datapath takes them (tenant id -> bucket), each clamped to its tier's floor;
    a tenant specs does not name is left out. The one clamp for the writer and for a reload's rewrite."""
    out = {}
    for name, lim in limits.items():
        if name in specs:
            lim = with_floor(lim, specs[name].floor)
            out[tenant_id(name)] = bucket(lim.rps, lim.burst)
    return out


class LimitsWriter:
    """tenants.LimitsWriter over the quota maps: overrides are clamped to the tier floor and expire in the kernel
    with the heartbeat."""

    def __init__(self, quota: Holder):
        self.quota = quota

    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        specs = self.quota.specs
        for name in limits:
            if name not in specs:  # e.g. removed by a reload the caller has not seen yet
                log.warning("override for unknown tenant %r ignored", name)
        out = override_buckets(limits, specs)
        self.quota.overrides = {n: v for n, v in limits.items() if n in specs}
        if self.quota.datapath is not None:
            self.quota.datapath.set_overrides(out)


class FleetWriter:
    """tenants.FleetWriter over the quota maps: each share is one more limit (the lowest holds), ending in the
    kernel with its lease or the heartbeat."""

    def __init__(self, quota: Holder):
        self.quota = quota

    def set_shares(self, shares: Mapping[str, tuple[TenantLimit, int]]) -> None:
        known = {n: v for n, v in shares.items() if n in self.quota.specs}
        self.quota.fleet = known
        if self.quota.datapath is not None:
            self.quota.datapath.set_fleet({tenant_id(n): (bucket(lim.rps, lim.burst), until)
                                           for n, (lim, until) in known.items()})
