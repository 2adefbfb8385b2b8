"""The fleet capability's part of the Snapshot, and the pure choice of each tenant's share on this node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from qosagent.fleet.agent import Seen
from qosagent.fleet.quotas import FleetQuota
from qosagent.snapshot import PartKey

Source = Literal["lease", "safe"]


@dataclass(frozen=True)
class TenantShare:
    tenant: str
    fleet_rps: float
    node_rps: float
    source: Source
    lease_age_s: float | None  # since the grant was last renewed; None before any grant
    until: float | None  # monotonic end of the lease (lease), None for the safe share


@dataclass(frozen=True)
class FleetPart:
    node: str
    seen: Seen
    now: float  # monotonic, the reporter's clock
    tenants: Mapping[str, TenantShare] = field(default_factory=dict)  # filled by decide (settled)


def shares(quotas: Mapping[str, FleetQuota], seen: Seen, now: float, lease: float, safe_share: float,
           margin: float) -> dict[str, TenantShare]:
    """Per tenant: the granted rate while its lease has more than `margin` (one tick) to run, else the safe share.
    A tenant the grant does not name (added since the allocator's last round) is on the safe share too."""
    out = {}
    age = None if seen.renewed_at is None else max(now - seen.renewed_at, 0.0)
    live = age is not None and age + margin < lease
    for tenant, q in quotas.items():
        if live and tenant in seen.grant:
            assert seen.renewed_at is not None
            out[tenant] = TenantShare(tenant, q.rps, min(seen.grant[tenant], q.rps), "lease", age,
                                      seen.renewed_at + lease)
        else:
            out[tenant] = TenantShare(tenant, q.rps, q.rps * safe_share, "safe", age, None)
    return out


FLEET = PartKey("fleet", FleetPart)
