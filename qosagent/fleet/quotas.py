"""Each tenant's fleet quota from the config (its own quota.fleet_rps/fleet_burst, else its tier's), and the
bucket a node enforces for a share of it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qosagent.config import Config
from qosagent.quota.rules import merged


@dataclass(frozen=True)
class FleetQuota:
    rps: float
    burst: int | None  # fleet-wide; None: a node's bucket holds a tenth of a second of its share


def fleet_quotas(cfg: Config) -> dict[str, FleetQuota]:
    out = {}
    for t in cfg.tenants:
        q = merged(t, cfg)
        if q is not None and q.fleet_rps is not None:
            out[t.name] = FleetQuota(q.fleet_rps, q.fleet_burst)
    return out


def node_burst(q: FleetQuota, node_rps: float) -> int:
    """The node's part of the fleet burst, in proportion to its share of the rate; at least one request."""
    if q.burst is None:
        return max(1, math.ceil(node_rps * 0.1))
    share = node_rps / q.rps if q.rps > 0 else 0.0
    return max(1, math.ceil(q.burst * share))
