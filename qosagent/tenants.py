"""Tenants as the kernel sees them: stable numeric ids, and the limits that travel from the loop to the quota maps.

A tenant's id is a hash of its name, so it stays the same across reorderings, reloads and agent restarts (pinned
maps keyed by it stay valid). Id 0 is traffic on a watched port that matches no tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

from qosagent.config import UNMATCHED, Config

UNMATCHED_ID = 0


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
    table = {UNMATCHED_ID: TenantInfo(UNMATCHED_ID, UNMATCHED, "none", 0, 0.0)}
    for t in cfg.tenants:
        tid = tenant_id(t.name)
        if tid in table:
            raise ValueError(f"tenant ids of {t.name!r} and {table[tid].name!r} collide; rename one")
        tier = cfg.tiers[t.tier]
        table[tid] = TenantInfo(tid, t.name, t.tier, tier.weight, tier.slo_p99)
    return table


@dataclass(frozen=True)
class TenantLimit:
    """A request-start token bucket: rate per second and burst. rps=0 drops every new request (shedding)."""

    rps: float
    burst: int


class LimitsWriter(Protocol):
    """What the quota capability offers the admission loop (AgentContext.services["quota.limits"])."""

    def baseline(self) -> Mapping[str, TenantLimit]:
        """The configured limits per tenant name (what the kernel falls back to when the heartbeat expires)."""
        ...

    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        """Replace the adaptive limits; tenants not named go back to baseline. Expire with the heartbeat."""
        ...
