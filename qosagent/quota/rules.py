"""From config to what the quota maps hold: tenant rules (the same rules the latency probes use) and limits.

Pure functions over the config, so that every rule can be tested without a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from qosagent.config import Config, QuotaSpec, TenantConfig
from qosagent.tenants import CidrEntry, TenantLimit, tenant_entries, tenant_id

MAX_NS = 1 << 60  # QOS_MAX_NS: no interval or tau beyond it, so the kernel's arithmetic cannot overflow


@dataclass(frozen=True)
class Bucket:
    """A GCRA token bucket: one token every interval_ns, at most tau_ns/interval_ns tokens."""

    interval_ns: int
    tau_ns: int

    @property
    def capacity(self) -> float:
        return self.tau_ns / self.interval_ns if self.interval_ns else 0.0


def bucket(rps: float, burst: int | None) -> Bucket:
    """rps 0 sheds every request (tau 0); otherwise the bucket holds max(burst, 1) tokens."""
    if rps <= 0:
        return Bucket(1_000_000_000, 0)
    interval = min(max(int(round(1e9 / rps)), 1), MAX_NS)
    cap = max(burst or 0, 1)
    return Bucket(interval, min(interval * cap, MAX_NS))


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def header_hash(name: str, value: str) -> int:
    """What the classifier computes from a header line: lowercase name, ':', the value after leading blanks."""
    return fnv1a64(name.lower().encode() + b":" + value.encode())


@dataclass(frozen=True)
class Rules:
    ports: dict[int, int]  # local port -> tenant id (tenant_ports)
    cidrs: list[CidrEntry]  # tenant_cidrs
    headers: dict[int, int]  # header_hash -> tenant id (quota_headers)
    watched: list[int]  # watched_ports


def rules(cfg: Config) -> Rules:
    """A port alone claims it for the tenant; ports with CIDRs bind the CIDRs to those ports; a header applies on any
    watched port (only to connections no port or CIDR claimed)."""
    ports, cidrs = tenant_entries(cfg)
    headers = {header_hash(t.match.header.name, t.match.header.value): tenant_id(t.name)
               for t in cfg.tenants if t.match.header}
    return Rules(ports, cidrs, headers, cfg.watched_ports())


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


def baseline_buckets(cfg: Config) -> dict[int, tuple[Bucket | None, Bucket | None]]:
    """The configured limits as the quota maps hold them: tenant id -> (request bucket, connection bucket), for the
    tenants with either."""
    out = {}
    for name, spec in baseline(cfg).items():
        req = bucket(spec.requests.rps, spec.requests.burst) if spec.requests else None
        conn = bucket(spec.connections.rps, spec.connections.burst) if spec.connections else None
        if req or conn:
            out[tenant_id(name)] = (req, conn)
    return out
