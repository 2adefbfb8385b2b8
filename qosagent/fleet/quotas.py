"""Each tenant's fleet quota from the config (its own quota.fleet_rps/fleet_burst, else its tier's), and the
bucket a node enforces for a share of it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qosagent.config import Config


@dataclass(frozen=True)
class FleetQuota:
    rps: float
    burst: int | None  # fleet-wide; None: a node's bucket holds a tenth of a second of its share


def fleet_quotas(cfg: Config) -> dict[str, FleetQuota]:
    out = {}
    for t in cfg.tenants:
        own, tier = t.quota, cfg.tiers[t.tier].quota
        rps = own.fleet_rps if own is not None and own.fleet_rps is not None else tier.fleet_rps if tier else None
        if rps is None:
            continue
        burst = own.fleet_burst if own is not None and own.fleet_burst is not None else \
            tier.fleet_burst if tier else None
        out[t.name] = FleetQuota(rps, burst)
    return out


def node_burst(q: FleetQuota, node_rps: float) -> int:
    """The node's part of the fleet burst, in proportion to its share of the rate; at least one request."""
    if q.burst is None:
        return max(1, math.ceil(node_rps * 0.1))
    share = node_rps / q.rps if q.rps > 0 else 0.0
    return max(1, math.ceil(q.burst * share))
