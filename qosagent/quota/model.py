"""The quota capability's part of the Snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from qosagent.tenants import TenantLimit
from qosagent.snapshot import PartKey


@dataclass(frozen=True)
class TenantQuota:
    tenant: str
    tier: str
    baseline: TenantLimit | None  # configured (tenant, else tier default); None = unlimited
    limit: TenantLimit | None  # in force now (an adaptive override while the heartbeat is fresh)
    admitted: int  # request starts admitted since the maps were created
    dropped: int  # request starts dropped by quota
    conn_admitted: int = 0
    conn_dropped: int = 0
    admitted_rps: float = 0.0  # over the last second
    dropped_rps: float = 0.0
    bucket_tokens: float | None = None


@dataclass(frozen=True)
class QuotaPart:
    tenants: Mapping[str, TenantQuota] = field(default_factory=dict)
    unmatched_packets: int = 0  # new connections and requests on watched ports that matched no tenant
    # The unmatched tenant's counts (admitted, dropped, connections admitted, dropped): never limited, still counted.
    unmatched_counts: tuple[int, int, int, int] = (0, 0, 0, 0)
    passed: Mapping[str, int] = field(default_factory=dict)  # packets passed without a quota check, by reason
    interfaces: tuple[str, ...] = ()  # where the classifier is attached
    pins: str | None = None
    others_on_hook: tuple[str, ...] = ()  # other filters and programs on the same hook, as probe found them
    # Serving network namespaces followed: netns, pid, ports, the host-side veths classified, tenants by port.
    namespaces: tuple[Mapping[str, Any], ...] = ()
    # Slots whose counts and buckets this tick read: those whose generation moved (quota_gen, qos_common.h).
    rows_read: int = 0


QUOTA = PartKey("quota", QuotaPart)
