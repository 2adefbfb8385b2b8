"""From config to what the quota maps hold: tenant rules (the same rules the latency probes use) and limits.

Pure functions over the config, so that every rule can be tested without a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from qosagent.config import Config
from qosagent.tenants import CidrEntry, baseline, tenant_entries, tenant_id

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
