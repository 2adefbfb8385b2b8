"""The allocator's decision: each tenant's fleet quota split over the nodes that report, as pure functions.

Two steps per tenant and round. `split` is the target: max-min fair by demand over the reporting nodes, every node
given at least a per-node minimum (a quiet node's new burst is admitted, measured and grown next round, never
starved), and what demand leaves unused spread in proportion to demand (headroom until the next round). `stage`
is what may be granted now without the fleet going over its quota: a node whose share shrinks gets its lower rate
at once, but a node whose share grows gets only what is free, counting every node at the higher of what it
reports it enforces (`held`) and what it is granted. A share moves from one node to another over two rounds: the
first lowers the giver, the second (once the giver has reported the lower rate) raises the taker.

The slack (docs/fleet.md): the allocator's sum of max(held, granted) never exceeds the quota; what a node enforces
above what it last reported comes only from falling back to the safe share (its lease lapsed without the
allocator knowing it), so a tenant's admitted rate fleet-wide exceeds its quota by at most the safe shares of the
nodes that lost their lease in the last report interval, plus those of nodes the allocator no longer hears from
(partitioned: their record expired while they enforce their safe share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

# The per-node minimum: at least this many request starts per second, or this fraction of an even split.
MIN_NODE_RPS = 1.0
MIN_NODE_FRACTION = 0.05


class Want(NamedTuple):
    """One node's report for one tenant: request starts per second it saw (admitted + dropped) and the rate it
    enforces now (its grant, or its safe share). A tuple: the allocator makes 100,000 a round."""

    demand: float
    held: float


@dataclass(frozen=True)
class TenantRound:
    """One tenant's outcome: the grants written and what the operator sees."""

    grants: Mapping[str, float]  # node -> rps
    target: Mapping[str, float]  # node -> rps the max-min split wants (grants reach it within a round or two)
    demand: float  # sum over nodes, each capped at the quota
    short: bool  # the quota is below nodes x minimum: split evenly, every node under its minimum
    committed: float  # sum over nodes of max(held, granted): never above the quota unless held already was


@dataclass(frozen=True)
class Round:
    tenants: Mapping[str, TenantRound] = field(default_factory=dict)

    def by_node(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for tenant, t in self.tenants.items():
            for node, rps in t.grants.items():
                out.setdefault(node, {})[tenant] = rps
        return out


def minimum(quota: float, nodes: int) -> float:
    return max(MIN_NODE_RPS, MIN_NODE_FRACTION * quota / max(nodes, 1))


def level(total: float, wants: list[float]) -> float:
    """The water level L with sum(min(w, L)) == total; inf when every want fits."""
    ws = sorted(wants)
    left, n = total, len(ws)
    for i, w in enumerate(ws):
        share = left / (n - i)
        if w >= share:
            return share
        left -= w
    return math.inf


def split(quota: float, demand: list[float]) -> tuple[list[float], bool]:
    """The target per node (in demand's order), and whether the quota was short of the per-node minimums."""
    n = len(demand)
    if n == 0:
        return [], False
    m = minimum(quota, n)
    if n * m >= quota:
        return [quota / n] * n, n * m > quota
    over = [d - m if d > m else 0.0 for d in demand]
    top = level(quota - n * m, over)
    out = [m + (o if o < top else top) for o in over]
    spare = quota - sum(out)
    if spare > 0:
        # In proportion to demand (evenly when there is none): a node limited by its grant reports little more
        # than the grant, so headroom where the demand is lets it show the rest in one round, not many.
        total = sum(demand)
        if total > 0:
            k = spare / total
            out = [v + k * d for v, d in zip(out, demand)]
        else:
            out = [v + spare / n for v in out]
    return out, False


def stage(quota: float, target: list[float], held: list[float]) -> tuple[list[float], float]:
    """Grants (in target's order) that move toward target without sum(max(held, granted)) going above the quota
    (unless held already was: then only decreases go out). Returns the grants and that sum."""
    free = quota - sum(held)
    want = sum(t - h for t, h in zip(target, held) if t > h)
    if want <= 0:
        free = want = 0.0  # decreases only
    if free >= want:  # every increase fits (or there is none)
        grants = list(target)
    else:
        f = max(free, 0.0) / want
        grants = [t if t <= h else h + f * (t - h) for t, h in zip(target, held)]
    committed = sum(h if h > g else g for g, h in zip(grants, held))
    return grants, committed


NUMBERS = (int, float)  # not bool: True is no rate


def clean(x: object, cap: float) -> float | None:
    """A reported rate as a number in [0, cap]; None when it is not a finite non-negative number. (On the
    allocator's hot path: 100,000 of these a round for 1,000 nodes x 100 tenants.)"""
    if x.__class__ not in NUMBERS or not 0 <= x < math.inf:  # type: ignore[operator]  # NaN fails both
        return None
    return float(x) if x < cap else cap  # type: ignore[operator]


def allocate(quotas: Mapping[str, float], reports: Mapping[str, Mapping[str, tuple[float, float]]]) -> Round:
    """quotas: tenant -> fleet rps; reports: node -> tenant -> Want or (demand, held), already validated, each
    value in [0, quota].
    Every reporting node gets a grant for every tenant with a fleet quota; a tenant a node did not mention has
    demand 0 and held 0 there (a node that just started: its safe share is what it holds, and it says so).
    Columns per tenant, in the nodes' order: lists, not dicts, since a round handles nodes x tenants of them."""
    nodes = list(reports)
    n = len(nodes)
    demand = {t: [0.0] * n for t in quotas}
    held = {t: [0.0] * n for t in quotas}
    for i, r in enumerate(reports.values()):
        for tenant, w in r.items():
            col = demand.get(tenant)
            if col is not None:
                col[i] = w[0]
                held[tenant][i] = w[1]
    out = {}
    for tenant, quota in sorted(quotas.items()):
        target, short = split(quota, demand[tenant])
        grants, committed = stage(quota, target, held[tenant])
        out[tenant] = TenantRound(dict(zip(nodes, grants)), dict(zip(nodes, target)), sum(demand[tenant]), short,
                                  committed)
    return Round(out)
