"""What a config makes of latency's tenant and port maps: each tenant's slot (its rows in the kernel's arrays) and
the entries every map holds. Pure: the capability writes what this plans, and keeps the plan in force so that a
reload can be undone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from qosagent.netns import NsRule, ns_rules
from qosagent.tenants import UNMATCHED_ID, TenantInfo, tenant_entries, tenant_table

if TYPE_CHECKING:
    from qosagent.config import Config


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


def assign_slots(have: Mapping[int, int], table: Mapping[int, TenantInfo], nslots: int) -> dict[int, int]:
    """Slots for table's tenants: those already numbered keep theirs (their counts since start go on), new ones take
    free ones; a tenant a reload removed keeps its slot, and its counts stay reported, until restart. ValueError when
    the arrays (sized at start) have no free slot left."""
    slots = dict(have)
    slots[UNMATCHED_ID] = 0
    free = sorted(set(range(nslots)) - set(slots.values()))
    for tid in table:
        if tid not in slots:
            if not free:
                raise ValueError(f"the latency arrays have {nslots} tenant slots, all taken by tenants configured "
                                 "since the agent started; restart it to time the new ones")
            slots[tid] = free.pop(0)
    return slots


def plan(cfg: "Config", have: Mapping[int, int], nslots: int) -> MapsPlan:
    """The maps as cfg wants them, the slots given so far kept; ValueError for a config they cannot hold."""
    table = tenant_table(cfg)
    ports, cidrs = tenant_entries(cfg)
    return MapsPlan(table, assign_slots(have, table, nslots), dict(ports), tuple(cidrs), tuple(cfg.tracked_ports()),
                    tuple(cfg.latency.multiplexed_ports), cfg.latency.window,
                    tuple(ns_rules(cfg.tenants)))
