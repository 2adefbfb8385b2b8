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

from dataclasses import dataclass, field
from typing import Iterator, Mapping

import numpy as np

# The per-node minimum: at least this many request starts per second, or this fraction of an even split.
MIN_NODE_RPS = 1.0
MIN_NODE_FRACTION = 0.05


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


# The split, the staging and the water level work on many tenants at once: columns of a nodes x tenants array
# (one per tenant, each against its own quota), numpy doing per element what Python did 100,000 times a round.

def level(total: np.ndarray, wants: np.ndarray) -> np.ndarray:
    """Per column, the water level L with sum(min(w, L)) == total; inf where every want fits."""
    n, k = wants.shape
    if n == 0:
        return np.full(k, np.inf)
    ws = np.sort(wants, axis=0)
    before = np.zeros_like(ws)
    np.cumsum(ws[:-1], axis=0, out=before[1:])
    share = (total - before) / (n - np.arange(n))[:, None]
    hit = ws >= share  # the first node whose want reaches the even share of what is left sets the level
    first = hit.argmax(axis=0)
    return np.where(hit.any(axis=0), share[first, np.arange(k)], np.inf)


def split(quota: np.ndarray, demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The target per node and tenant (demand's shape, nodes x tenants), and per tenant whether its quota was
    short of the per-node minimums (then split evenly)."""
    n, k = demand.shape
    if n == 0:
        return np.zeros((0, k)), np.zeros(k, dtype=bool)
    m = np.maximum(MIN_NODE_RPS, MIN_NODE_FRACTION * quota / n)
    over = np.maximum(demand - m, 0.0)
    out = m + np.minimum(over, level(quota - n * m, over))
    spare = np.maximum(quota - out.sum(axis=0), 0.0)
    # In proportion to demand (evenly when there is none): a node limited by its grant reports little more than
    # the grant, so headroom where the demand is lets it show the rest in one round, not many.
    total = demand.sum(axis=0)
    some = total > 0
    out += np.where(some, spare / np.where(some, total, 1.0), 0.0) * demand + np.where(some, 0.0, spare / n)
    even = n * m >= quota
    return np.where(even, quota / n, out), n * m > quota


def stage(quota: np.ndarray, target: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Grants (target's shape) that move toward target without a tenant's sum(max(held, granted)) going above its
    quota (unless held already was: then only decreases go out). Returns the grants and those sums."""
    want = np.maximum(target - held, 0.0).sum(axis=0)
    rise = want > 0  # else decreases only
    free = np.where(rise, quota - held.sum(axis=0), 0.0)
    f = np.maximum(free, 0.0) / np.where(rise, want, 1.0)
    partial = np.where(target <= held, target, held + f * (target - held))
    grants = np.where(free >= np.where(rise, want, 0.0), target, partial)  # every increase fits (or none)
    return grants, np.maximum(grants, held).sum(axis=0)


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
            top = float(level(np.array([left]), np.array(wants)[:, None])[0])
            for t, want in zip(members, wants):
                give = want if want < top else top
                out[t] += give
                left -= give
    return out, False


class Column(Mapping[str, float]):
    """A tenant's rates by node: a view of one column of the round, built for every re-split tenant each round (a
    dict of 1,000 nodes each was a tenth of a round). The index is the ledger's, replaced (never changed) when
    the nodes change; the array is the round's own copy."""

    __slots__ = ("index", "array")

    def __init__(self, index: Mapping[str, int], array: np.ndarray):
        self.index = index
        self.array = array

    def __getitem__(self, node: str) -> float:
        return float(self.array[self.index[node]])

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def values(self) -> list[float]:  # type: ignore[override]  # in the nodes' order, as iteration
        return self.array.tolist()  # type: ignore[no-any-return]


Row = tuple[np.ndarray, np.ndarray]  # a node's demand and held, in the ledger's tenants' order


class Ledger:
    """The allocator's state between rounds (pure: no I/O): the reports as two nodes x tenants arrays (demand
    and held, a changed report replacing one row) and the last round's grants beside them. A round re-splits
    only the tenants whose column or pool moved, all of them at once, and names the nodes whose grant changed,
    so a fleet whose demand holds still costs the allocator (and etcd) almost nothing. `allocate` is one round
    of a new Ledger: the incremental path and the pure one are the same code."""

    def __init__(self, quotas: Mapping[str, float], capacity: float | None = None,
                 weights: Mapping[str, int] | None = None):
        self.quotas = dict(quotas)
        self.names = sorted(quotas)  # the tenants' order in rows and columns (reports list them sorted too)
        self.quota = np.array([quotas[t] for t in self.names], dtype=float)
        self.capacity = capacity
        self.weights = dict(weights or {})
        self.nodes: list[str] = []
        self.index: dict[str, int] = {}
        self.rows: dict[str, Row] = {}
        k = len(self.names)
        self.demand = np.zeros((0, k))  # nodes x tenants, in self.nodes' order
        self.held = np.zeros((0, k))
        self.grants = np.zeros((0, k))
        self.out: dict[str, TenantRound] = {}
        self.capacity_short = False

    def row(self, r: Row | Mapping[str, tuple[float, float]]) -> Row:
        """A report as the ledger keeps it: a decoded one already is; a mapping tenant -> (demand, held) (the
        pure allocate()'s input) is laid out in the tenants' order, 0 for a tenant it does not name."""
        if isinstance(r, tuple):
            return r
        zero = (0.0, 0.0)
        return (np.array([r.get(t, zero)[0] for t in self.names], dtype=float),
                np.array([r.get(t, zero)[1] for t in self.names], dtype=float))

    def round(self, nodes: list[str], changed: Mapping[str, Row | Mapping[str, tuple[float, float]]]
              ) -> tuple[Round, set[str], set[str]]:
        """nodes: every reporting node, in a stable order; changed: the reports (each value in [0, quota]) of the
        nodes new or changed since the last round. Returns the round, the nodes whose grant changed and the
        tenants re-split."""
        k = len(self.names)
        dirty = np.zeros(k, dtype=bool)
        rows = {node: self.row(r) for node, r in changed.items()}
        if nodes != self.nodes or not self.out or any(n not in self.index for n in rows):
            keep = set(nodes)
            self.rows = {n: r for n, r in (self.rows | rows).items() if n in keep}
            old_index, old_grants = self.index, self.grants
            self.nodes = list(nodes)
            self.index = {node: i for i, node in enumerate(self.nodes)}
            empty = np.zeros((0, k))
            self.demand = np.array([self.rows[n][0] for n in self.nodes]).reshape(-1, k) if nodes else empty
            self.held = np.array([self.rows[n][1] for n in self.nodes]).reshape(-1, k) if nodes else empty
            # Each node's grants of the last round in the new order (none for a new node: it always moves).
            self.grants = np.full((len(nodes), k), np.nan)
            kept = [(i, old_index[n]) for i, n in enumerate(self.nodes) if n in old_index]
            if kept:
                self.grants[[i for i, _ in kept]] = old_grants[[j for _, j in kept]]
            dirty[:] = True
        elif rows:
            self.rows.update(rows)
            at = [self.index[n] for n in rows]
            d = np.array([r[0] for r in rows.values()])
            h = np.array([r[1] for r in rows.values()])
            dirty |= (self.demand[at] != d).any(axis=0) | (self.held[at] != h).any(axis=0)
            self.demand[at], self.held[at] = d, h
        pool = self.quota
        if self.capacity is not None:
            sums = self.demand.sum(axis=0)
            parts, self.capacity_short = pools(self.capacity, self.quotas, dict(zip(self.names, sums.tolist())),
                                               len(self.nodes), self.weights)
            pool = np.array([parts[t] for t in self.names])
            dirty |= np.array([t not in self.out or self.out[t].pool != p for t, p in zip(self.names, pool)])
        cols = np.flatnonzero(dirty)
        target, short = split(pool[cols], self.demand[:, cols])
        grants, committed = stage(pool[cols], target, self.held[:, cols])
        if self.capacity is not None:
            cols, target, short, grants, committed = self._fit(pool, cols, target, short, grants, committed)
        moved_rows = np.flatnonzero((self.grants[:, cols] != grants).any(axis=1))
        self.grants[:, cols] = grants
        sums = self.demand[:, cols].sum(axis=0)
        for c, j in enumerate(cols.tolist()):
            self.out[self.names[j]] = TenantRound(
                Column(self.index, grants[:, c].copy()), Column(self.index, target[:, c].copy()),
                float(sums[c]), bool(short[c]), float(committed[c]), float(pool[j]))
        return (Round(dict(self.out), self.capacity_short), {self.nodes[i] for i in moved_rows.tolist()},
                {self.names[j] for j in cols.tolist()})

    def _fit(self, pool: np.ndarray, cols: np.ndarray, target: np.ndarray, short: np.ndarray, grants: np.ndarray,
             committed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Staging across tenants: a tenant whose pool grew may take only what the others' held rates leave of the
        capacity (their decreases go out at once, their increases wait until the givers report them), so the sum
        over tenants of their committed rates stays within fleet.capacity_rps as each tenant's stays within its
        pool. The growing tenants share what is free in proportion to what they would have taken. Returns the
        columns re-split (cols and those restaged) with their targets, flags, grants and committed sums."""
        assert self.capacity is not None
        base = self.held.sum(axis=0)
        every = np.array([self.out[t].committed if t in self.out else 0.0 for t in self.names])
        every[cols] = committed
        grow = np.where(every > base + 1e-9, every - base, 0.0)
        if every.sum() - self.capacity <= 1e-9 or not grow.any():
            return cols, target, short, grants, committed
        # Every tenant's committed is at least its base (held), and those not growing are at it.
        f = min(max(self.capacity - base.sum(), 0.0) / grow.sum(), 1.0)
        at = np.flatnonzero(grow > 0)
        # The growing tenants not re-split this round keep their target and flag; they are restaged too.
        extra = np.setdiff1d(at, cols)
        cols = np.concatenate([cols, extra])
        target = np.hstack([target, np.column_stack([self.out[self.names[j]].target.array for j in extra])
                            if len(extra) else np.zeros((len(self.nodes), 0))])
        short = np.concatenate([short, [self.out[self.names[j]].short for j in extra]]).astype(bool)
        grants = np.hstack([grants, np.zeros((len(self.nodes), len(extra)))])
        committed = np.concatenate([committed, np.zeros(len(extra))])
        pos = {j: c for c, j in enumerate(cols.tolist())}
        c = np.array([pos[j] for j in at.tolist()], dtype=np.intp)
        grants[:, c], committed[c] = stage(base[at] + f * grow[at], target[:, c], self.held[:, at])
        return cols, target, short, grants, committed


def allocate(quotas: Mapping[str, float], reports: Mapping[str, Mapping[str, tuple[float, float]]],
             capacity: float | None = None, weights: Mapping[str, int] | None = None) -> Round:
    """One round from scratch. quotas: tenant -> fleet rps; reports: node -> tenant -> records.Want or (demand, held),
    already validated, each value in [0, quota]; capacity: fleet.capacity_rps (None: tenants never compete);
    weights: tenant -> its tier's weight. Every reporting node gets a grant for every tenant with a fleet quota."""
    return Ledger(quotas, capacity, weights).round(list(reports), reports)[0]
