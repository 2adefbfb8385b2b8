"""The allocator's decision: each tenant's fleet quota split over the nodes that report, as pure functions.

Two steps per tenant and round. `split` is the target: max-min fair by demand over the reporting nodes, every node
given at least a per-node minimum (a quiet node's new burst is admitted, measured and grown next round, never
starved), and what demand leaves unused spread in proportion to demand (headroom until the next round). `stage`
is what may be granted now without the fleet going over its quota: a node whose share shrinks gets its lower rate
at once, but a node whose share grows gets only what is free, counting every node at the higher of what it
reports it enforces (`held`) and what it is granted. A share moves from one node to another over two rounds: the
first lowers the giver, the second (once the giver has reported the lower rate) raises the taker.

With fleet.capacity_rps, tenants compete: `pools` gives each its part of the capacity (floors first, then the
tiers by weight), each tenant is split and staged within its part, and `Ledger._fit` stages across tenants the
same way, so the sum of every tenant's committed rate stays within the capacity.

The slack (docs/fleet.md): the allocator's sum of max(held, granted) never exceeds the quota; what a node enforces
above what it last reported comes only from falling back to the safe share (its lease lapsed without the
allocator knowing it), so a tenant's admitted rate fleet-wide exceeds its quota by at most the safe shares of the
nodes that lost their lease in the last report interval, plus those of nodes the allocator no longer hears from
(partitioned: their record expired while they enforce their safe share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import repeat
from operator import sub
from typing import Iterable, Mapping, NamedTuple

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
    pool: float  # what the tenant may have this round: its fleet_rps, less when fleet.capacity_rps is short


@dataclass(frozen=True)
class Round:
    tenants: Mapping[str, TenantRound] = field(default_factory=dict)
    capacity_short: bool = False  # fleet.capacity_rps below every tenant's floor: each got a part of its floor

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
    # map() over built-ins rather than generators: this runs per tenant on every node each round.
    want = sum(map(max, map(sub, target, held), repeat(0.0)))
    if want <= 0:
        free = want = 0.0  # decreases only
    if free >= want:  # every increase fits (or there is none)
        grants = list(target)
    else:
        f = max(free, 0.0) / want
        grants = [t if t <= h else h + f * (t - h) for t, h in zip(target, held)]
    committed = sum(map(max, grants, held))
    return grants, committed


NUMBERS = (int, float)  # not bool: True is no rate


def clean(x: object, cap: float) -> float | None:
    """A reported rate as a number in [0, cap]; None when it is not a finite non-negative number. (On the
    allocator's hot path: 100,000 of these a round for 1,000 nodes x 100 tenants.)"""
    if x.__class__ not in NUMBERS or not 0 <= x < math.inf:  # type: ignore[operator]  # NaN fails both
        return None
    return float(x) if x < cap else cap  # type: ignore[operator]


def pools(capacity: float, quotas: Mapping[str, float], demand: Mapping[str, float], nodes: int,
          weights: Mapping[str, int]) -> tuple[dict[str, float], bool]:
    """Each tenant's part of fleet.capacity_rps, the pool its own split works within (never above its fleet_rps).

    Every tenant first gets its floor (the per-node minimum on every node, at most its quota: no tenant is ever
    black-holed); then the tiers by weight, heaviest first, each tenant up to its demand (max-min fair within a
    tier when the tier does not fit); then, heaviest first again, up to each tenant's quota (headroom, so demand
    can grow into it). A tier's tenants are so served before the next tier's when the fleet is short. When even
    the floors do not fit, each tenant gets its floor's part of the capacity (the second value says so)."""
    floor = {t: min(q, nodes * minimum(q, nodes)) if nodes else q for t, q in quotas.items()}
    total = sum(floor.values())
    if total >= capacity:
        return {t: capacity * f / total if total > 0 else 0.0 for t, f in floor.items()}, total > capacity
    left = capacity - total
    out = dict(floor)
    tiers = sorted({weights.get(t, 1) for t in quotas}, reverse=True)
    for upto in ({t: min(demand.get(t, 0.0), q) for t, q in quotas.items()}, quotas):
        for w in tiers:
            if left <= 0:
                return out, False
            members = [t for t in sorted(quotas) if weights.get(t, 1) == w]
            wants = [max(upto[t] - out[t], 0.0) for t in members]
            top = level(left, wants)
            for t, want in zip(members, wants):
                give = want if want < top else top
                out[t] += give
                left -= give
    return out, False


class Ledger:
    """The allocator's state between rounds (pure: no I/O). Per node, its demand and held rates in the tenants'
    order (rows: a changed report replaces one row, not a hundred cells); per tenant, the columns its split reads,
    rebuilt from the rows only for the tenants that moved. A round re-splits only the tenants whose column or
    pool moved, and names the nodes whose grant changed, so a fleet whose demand holds still costs the allocator
    (and etcd) almost nothing. `allocate` is one round of a new Ledger: the incremental path and the pure one are
    the same code."""

    def __init__(self, quotas: Mapping[str, float], capacity: float | None = None,
                 weights: Mapping[str, int] | None = None):
        self.quotas = dict(quotas)
        self.names = sorted(quotas)  # the tenants' order in rows (reports list them sorted too)
        self.capacity = capacity
        self.weights = dict(weights or {})
        self.nodes: list[str] = []
        self.index: dict[str, int] = {}
        self.rows: dict[str, tuple[list[float], list[float]]] = {}  # node -> (demand row, held row)
        self.demand: dict[str, list[float]] = {}  # tenant -> column, in the nodes' order
        self.held: dict[str, list[float]] = {}
        self.out: dict[str, TenantRound] = {}
        self.capacity_short = False

    def _row(self, r: Mapping[str, tuple[float, float]]) -> tuple[list[float], list[float]]:
        if list(r) == self.names:  # the usual report: every tenant, sorted
            pairs = list(r.values())
            return [p[0] for p in pairs], [p[1] for p in pairs]
        zero = (0.0, 0.0)
        return [r.get(t, zero)[0] for t in self.names], [r.get(t, zero)[1] for t in self.names]

    def _columns(self, tenants: Iterable[str]) -> None:
        rows = [self.rows[n] for n in self.nodes]
        for t in tenants:
            j = self.names.index(t)
            self.demand[t] = [r[0][j] for r in rows]
            self.held[t] = [r[1][j] for r in rows]

    def round(self, nodes: list[str], changed: Mapping[str, Mapping[str, tuple[float, float]]]
              ) -> tuple[Round, set[str], set[str]]:
        """nodes: every reporting node, in a stable order; changed: the reports (tenant -> (demand, held), each in
        [0, quota]) of the nodes new or changed since the last round. A tenant a node does not mention has demand
        0 and held 0 there. Returns the round, the nodes whose grant changed and the tenants re-split."""
        everyone = set(self.quotas)
        dirty: set[str] = set()
        for node, r in changed.items():
            row, old = self._row(r), self.rows.get(node)
            self.rows[node] = row
            if old is None or len(dirty) == len(everyone):
                continue
            for a, b in ((old[0], row[0]), (old[1], row[1])):
                if a != b:
                    dirty.update(t for t, x, y in zip(self.names, a, b) if x != y)
        if nodes != self.nodes or len(self.rows) != len(nodes) or not self.out:
            keep = set(nodes)
            self.rows = {n: r for n, r in self.rows.items() if n in keep}
            self.nodes = list(nodes)
            self.index = {node: i for i, node in enumerate(self.nodes)}
            dirty = everyone
        self._columns(dirty)
        pool = dict(self.quotas)
        if self.capacity is not None:
            pool, self.capacity_short = pools(self.capacity, self.quotas, {
                t: sum(c) for t, c in self.demand.items()}, len(self.nodes), self.weights)
            dirty |= {t for t, p in pool.items() if t not in self.out or self.out[t].pool != p}
        new: dict[str, tuple[list[float], list[float], bool, float]] = {}
        for tenant in sorted(dirty):
            target, short = split(pool[tenant], self.demand[tenant])
            grants, committed = stage(pool[tenant], target, self.held[tenant])
            new[tenant] = grants, target, short, committed
        if self.capacity is not None:
            self._fit(pool, new, dirty)
        moved: set[str] = set()
        for tenant, (grants, target, short, committed) in new.items():
            old = self.out.get(tenant)
            g = dict(zip(self.nodes, grants))
            if old is None or old.grants.keys() != g.keys():
                moved.update(n for n, v in g.items() if old is None or old.grants.get(n) != v)
            elif list(old.grants.values()) != grants:
                moved.update(n for n, a, b in zip(self.nodes, grants, old.grants.values()) if a != b)
            self.out[tenant] = TenantRound(g, dict(zip(self.nodes, target)), sum(self.demand[tenant]), short,
                                           committed, pool[tenant])
        return Round(dict(self.out), self.capacity_short), moved, dirty

    def _fit(self, pool: dict[str, float], new: dict[str, tuple[list[float], list[float], bool, float]],
             dirty: set[str]) -> None:
        """Staging across tenants: a tenant whose pool grew may take only what the others' held rates leave of the
        capacity (their decreases go out at once, their increases wait until the givers report them), so the sum
        over tenants of their committed rates stays within fleet.capacity_rps as each tenant's stays within its
        pool. The growing tenants share what is free in proportion to what they would have taken."""
        assert self.capacity is not None
        base = {t: sum(self.held[t]) for t in self.quotas}
        committed = {t: new[t][3] if t in new else self.out[t].committed for t in self.quotas}
        grow = {t: committed[t] - base[t] for t in self.quotas if committed[t] > base[t] + 1e-9}
        over = sum(committed.values()) - self.capacity
        if over <= 1e-9 or not grow:
            return
        # Every tenant's committed is at least its base (held), and those not growing are at it.
        f = min(max(self.capacity - sum(base.values()), 0.0) / sum(grow.values()), 1.0)
        for t, g in grow.items():
            target = new[t][1] if t in new else list(self.out[t].target.values())
            grants, c = stage(base[t] + f * g, target, self.held[t])
            new[t] = grants, target, new[t][2] if t in new else self.out[t].short, c
            dirty.add(t)


def allocate(quotas: Mapping[str, float], reports: Mapping[str, Mapping[str, tuple[float, float]]],
             capacity: float | None = None, weights: Mapping[str, int] | None = None) -> Round:
    """One round from scratch. quotas: tenant -> fleet rps; reports: node -> tenant -> Want or (demand, held),
    already validated, each value in [0, quota]; capacity: fleet.capacity_rps (None: tenants never compete);
    weights: tenant -> its tier's weight. Every reporting node gets a grant for every tenant with a fleet quota."""
    return Ledger(quotas, capacity, weights).round(list(reports), reports)[0]
