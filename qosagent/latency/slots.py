"""What a config makes of latency's tenant and port maps: each tenant's slot (its rows in the kernel's arrays) and
the entries every map holds. Pure: the capability writes what this plans, and keeps the plan in force so that a
reload can be undone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Iterable, Mapping, TypeVar

from qosagent.latency import bpfmaps as bm
from qosagent.netns import NsRule, ns_rules
from qosagent.tenants import UNMATCHED_ID, TenantInfo, tenant_entries, tenant_table

if TYPE_CHECKING:
    from qosagent.config import Config

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class MapsPlan:
    tenants: dict[int, TenantInfo]
    slots: dict[int, int]  # tenant id -> its slot (row) in the kernel's arrays; 0 is unmatched traffic's
    ports: dict[int, int]  # port -> the tenant that claims it alone
    cidrs: tuple[Any, ...]
    tracked: tuple[int, ...]
    mux: tuple[int, ...]
    window: float
    # match.process and match.pods tenants, for lat_netns (qosagent/latency/pods.py)
    namespace_rules: tuple[NsRule, ...] = ()
    # Run-queue rows (bpfmaps.RUNQ_SHARED is the shared one): tier -> its row, and slot -> the row of its tenant's
    # tier (lat_slot_tier; a slot left out, as one a reload's removed tenant keeps, has the shared row). Empty while
    # run-queue latency is off.
    runq_rows: dict[str, int] = field(default_factory=dict)
    slot_rows: dict[int, int] = field(default_factory=dict)


def _number(have: Mapping[K, int], wanted: Iterable[K], first: int, n: int, full: str) -> dict[K, int]:
    """Numbers first..n-1 for wanted: those numbered keep theirs (their counts since start go on), new ones take free
    ones, and one a reload left out keeps its number until restart. ValueError(full) when none is free."""
    out = dict(have)
    free = sorted(set(range(first, n)) - set(out.values()))
    for key in wanted:
        if key not in out:
            if not free:
                raise ValueError(full)
            out[key] = free.pop(0)
    return out


def assign_slots(have: Mapping[int, int], table: Mapping[int, TenantInfo], nslots: int) -> dict[int, int]:
    """Slots for table's tenants, unmatched traffic's being 0; ValueError when the arrays (sized at start) have no free
    slot left."""
    return _number({**have, UNMATCHED_ID: 0}, table, 0, nslots,
                   f"the latency arrays have {nslots} tenant slots, all taken by tenants configured since the agent "
                   "started; restart it to time the new ones")


def assign_runq_rows(have: Mapping[str, int], table: Mapping[int, TenantInfo], nrows: int) -> dict[str, int]:
    """Run-queue rows for the tiers of table's tenants (unmatched traffic's "none" among them), after the shared row;
    none when nrows is 0 (run-queue latency off); ValueError when no row is free (they are sized at start)."""
    if not nrows:
        return {}
    return _number(have, sorted({t.tier for t in table.values()}), bm.RUNQ_SHARED + 1, nrows,
                   f"the latency run-queue histogram has rows for {nrows - 1} tiers, all taken by tiers given "
                   "tenants since the agent started; restart it to time the new ones")


def plan(cfg: "Config", have: Mapping[int, int], nslots: int, have_rows: Mapping[str, int] | None = None,
         nrows: int = 0) -> MapsPlan:
    """The maps as cfg wants them, the slots and run-queue rows given so far kept; ValueError for a config they cannot
    hold."""
    table = tenant_table(cfg)
    ports, cidrs = tenant_entries(cfg)
    slots = assign_slots(have, table, nslots)
    rows = assign_runq_rows(have_rows or {}, table, nrows)
    slot_rows = {slot: rows[table[tid].tier] for tid, slot in slots.items() if tid in table} if rows else {}
    return MapsPlan(table, slots, dict(ports), tuple(cidrs), tuple(cfg.tracked_ports()),
                    tuple(cfg.latency.multiplexed_ports), cfg.latency.window,
                    tuple(ns_rules(cfg.tenants)), rows, slot_rows)
