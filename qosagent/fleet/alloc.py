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


def water_fill(total: float, wants: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair: each gets min(want, level), the level such that the total is used or every want met."""
    top = level(total, list(wants.values()))
    return {node: w if w < top else top for node, w in wants.items()}


def split(quota: float, demand: Mapping[str, float]) -> tuple[dict[str, float], bool]:
    """The target per node, and whether the quota was short of the per-node minimums."""
    n = len(demand)
    if n == 0:
        return {}, False
    m = minimum(quota, n)
    if n * m >= quota:
        return {node: quota / n for node in demand}, n * m > quota
    extra = water_fill(quota - n * m, {node: max(d - m, 0.0) for node, d in demand.items()})
    out = {node: m + extra[node] for node in demand}
    spare = quota - sum(out.values())
    if spare > 0:
        # In proportion to demand (evenly when there is none): a node limited by its grant reports little more
        # than the grant, so headroom where the demand is lets it show the rest in one round, not many.
        total = sum(demand.values())
        out = {node: v + spare * (demand[node] / total if total > 0 else 1 / n) for node, v in out.items()}
    return out, False


def stage(quota: float, target: Mapping[str, float], held: Mapping[str, float]) -> tuple[dict[str, float], float]:
    """Grants that move toward target without sum(max(held, granted)) going above the quota (unless held already
    was: then only decreases go out). Returns the grants and that sum."""
    nodes = list(target)
    tv = list(target.values())
    hv = [held.get(node, 0.0) for node in nodes]
    free = quota - sum(hv)
    want = sum(t - h for t, h in zip(tv, hv) if t > h)
    if want <= 0:
        free = want = 0.0  # decreases only
    if free >= want:  # every increase fits (or there is none)
        grants = dict(zip(nodes, tv))
    else:
        f = max(free, 0.0) / want
        grants = {node: t if t <= h else h + f * (t - h) for node, t, h in zip(nodes, tv, hv)}
    committed = sum(h if h > g else g for g, h in zip(grants.values(), hv))
    return grants, committed


NUMBERS = (int, float)  # not bool: True is no rate


def clean(x: object, cap: float) -> float | None:
    """A reported rate as a number in [0, cap]; None when it is not a finite non-negative number. (On the
    allocator's hot path: 100,000 of these a round for 1,000 nodes x 100 tenants.)"""
    if x.__class__ not in NUMBERS or not 0 <= x < math.inf:  # type: ignore[operator]  # NaN fails both
        return None
    return float(x) if x < cap else cap  # type: ignore[operator]


def allocate(quotas: Mapping[str, float], reports: Mapping[str, Mapping[str, Want]]) -> Round:
    """quotas: tenant -> fleet rps; reports: node -> tenant -> Want (already validated, each value in [0, quota]).
    Every reporting node gets a grant for every tenant with a fleet quota; a tenant a node did not mention has
    demand 0 and held 0 there (a node that just started: its safe share is what it holds, and it says so)."""
    demand: dict[str, dict[str, float]] = {t: {} for t in quotas}
    held: dict[str, dict[str, float]] = {t: {} for t in quotas}
    for node, r in reports.items():
        for tenant, w in r.items():
            if tenant in demand:
                demand[tenant][node] = w.demand
                held[tenant][node] = w.held
    out = {}
    for tenant, quota in sorted(quotas.items()):
        d, h = demand[tenant], held[tenant]
        if len(d) < len(reports):
            d = {node: d.get(node, 0.0) for node in reports}
        d = {node: v if v < quota else quota for node, v in d.items()}
        target, short = split(quota, d)
        grants, committed = stage(quota, target, {node: v if v < quota else quota for node, v in h.items()})
        out[tenant] = TenantRound(grants, target, sum(d.values()), short, committed)
    return Round(out)
