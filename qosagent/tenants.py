"""Tenants as the kernel sees them: stable numeric ids, and the limits that travel from the loop to the quota maps.

A tenant's id is a hash of its name, so it stays the same across reorderings, reloads and agent restarts (pinned
maps keyed by it stay valid). Id 0 is traffic on a watched port that matches no tenant.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Mapping, Protocol

from qosagent.config import UNMATCHED, UNMATCHED_TIER, Config, QuotaSpec, TenantConfig

UNMATCHED_ID = 0
# What the quota capability offers in AgentContext.services: a LimitsWriter (admission's) and a FleetWriter (fleet's).
LIMITS_SERVICE = "quota.limits"
FLEET_SERVICE = "quota.fleet"


def tenant_id(name: str) -> int:
    """32-bit FNV-1a of the name, never 0."""
    h = 0x811C9DC5
    for b in name.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h or 1


@dataclass(frozen=True)
class TenantInfo:
    id: int
    name: str
    tier: str
    weight: int
    slo_p99: float


def tenant_table(cfg: Config) -> dict[int, TenantInfo]:
    """id -> tenant, with the unmatched pseudo-tenant; raises ValueError on a (vanishingly rare) id collision."""
    table = {UNMATCHED_ID: TenantInfo(UNMATCHED_ID, UNMATCHED, UNMATCHED_TIER, 0, 0.0)}
    for t in cfg.tenants:
        tid = tenant_id(t.name)
        if tid in table:
            raise ValueError(f"tenant ids of {t.name!r} and {table[tid].name!r} collide; rename one")
        tier = cfg.tiers[t.tier]
        table[tid] = TenantInfo(tid, t.name, t.tier, tier.weight, tier.slo_p99)
    return table


CIDR_PORT_BITS = 16  # a qos_cidr_key's prefix counts the port before the address


def mapped16(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> tuple[bytes, int]:
    """A network as a 16-byte address and prefix length; IPv4 as ::ffff:a.b.c.d, the way the kernel reports peers."""
    if isinstance(net, ipaddress.IPv4Network):
        return b"\0" * 10 + b"\xff\xff" + net.network_address.packed, 96 + net.prefixlen
    return net.network_address.packed, net.prefixlen


@dataclass(frozen=True)
class CidrEntry:
    """One tenant_cidrs entry: (prefixlen counted from the port, port in host order or 0, 16-byte address)."""

    prefixlen: int
    port: int
    addr: bytes
    tenant: int


def tenant_entries(cfg: Config) -> tuple[dict[int, int], list[CidrEntry]]:
    """What tenant_ports and tenant_cidrs hold, for every program that resolves tenants (latency and quota alike,
    so that a tenant's latency and its quota describe the same traffic).

    A tenant matching ports alone claims those ports (tenant_ports). One matching CIDRs claims those client
    addresses on each of its ports, or on every watched port (port 0) when it names none. Header rules are the quota
    classifier's own map (only TC sees payload); process and pods rules each program's own, per serving network
    namespace (quota_netns by host-side veth, lat_netns by the namespace's addresses)."""
    ports: dict[int, int] = {}
    cidrs: list[CidrEntry] = []
    for t in cfg.tenants:
        tid = tenant_id(t.name)
        m = t.match
        if m.per_namespace:
            continue  # per serving network namespace: quota_netns, lat_netns
        if m.claims_ports:
            for p in m.ports:
                ports[p] = tid
            continue
        for c in m.cidrs:
            addr, plen = mapped16(ipaddress.ip_network(c, strict=False))
            for p in m.ports or [0]:
                cidrs.append(CidrEntry(CIDR_PORT_BITS + plen, p, addr, tid))
    return ports, cidrs


@dataclass(frozen=True)
class TenantLimit:
    """A request-start token bucket: rate per second and burst. rps=0 drops every new request (shedding)."""

    rps: float
    burst: int


# The configured limits per tenant, which quota writes as its baseline and admission starts from (also without
# quota): a reading of the config both need, here rather than in either.


def _merged(t: TenantConfig, cfg: Config) -> QuotaSpec | None:
    tier = cfg.tiers[t.tier].quota
    own = t.quota
    if own is None and tier is None:
        return None
    fields = {}
    for k in QuotaSpec.model_fields:
        v = getattr(own, k) if own is not None else None
        fields[k] = v if v is not None else (getattr(tier, k) if tier is not None else None)
    return QuotaSpec(**fields)


@dataclass(frozen=True)
class TenantQuotaSpec:
    requests: TenantLimit | None  # None: request starts unlimited
    connections: TenantLimit | None  # new connections; burst = one second of the rate, at least 1
    floor: TenantLimit | None  # the tier's guaranteed floor: adaptive overrides never go below


def limit_of(rps: float, burst: int | None = None) -> TenantLimit:
    """A configured rate as a limit: without a burst, one second's worth is admitted at once (at least one)."""
    return TenantLimit(rps, burst if burst is not None else max(int(rps), 1))


def baseline(cfg: Config) -> dict[str, TenantQuotaSpec]:
    """The configured quotas per tenant: the tenant's own fields, else its tier's defaults."""
    out = {}
    for t in cfg.tenants:
        q = _merged(t, cfg)
        req = conn = None
        if q is not None and q.rps is not None:
            req = limit_of(q.rps, q.burst)
        if q is not None and q.connections_per_s is not None:
            conn = limit_of(q.connections_per_s)
        fl = cfg.tiers[t.tier].floor
        floor = limit_of(fl.rps, fl.burst) if fl is not None and fl.rps is not None else None
        out[t.name] = TenantQuotaSpec(req, conn, floor)
    return out


def with_floor(limit: TenantLimit, floor: TenantLimit | None) -> TenantLimit:
    if floor is None:
        return limit
    return TenantLimit(max(limit.rps, floor.rps), max(limit.burst, floor.burst))


class LimitsWriter(Protocol):
    """What the quota capability offers the admission loop (AgentContext.services["quota.limits"])."""

    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        """Replace the adaptive limits; tenants not named go back to baseline. Expire with the heartbeat."""
        ...


FLEET_NO_END = (1 << 64) - 1  # a fleet share without a lease (the safe share): it ends with the heartbeat alone


class FleetWriter(Protocol):
    """What the quota capability offers the fleet capability (AgentContext.services["quota.fleet"])."""

    def set_shares(self, shares: Mapping[str, tuple[TenantLimit, int]]) -> None:
        """Replace this node's fleet shares: tenant name -> (limit, end of its lease as CLOCK_MONOTONIC ns). A share
        is one more limit beside baseline and override (the lowest rate holds); it ends with its lease or the
        heartbeat, whichever comes first. Tenants not named have none."""
        ...
