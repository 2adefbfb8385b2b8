"""Run-queue latency by tier, the agent's side: which row each tier's waits are counted in (slots.py), the tick's
windows over the rows and their sum (reading.py), and what status and the metrics make of them (export.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from qosagent.config import parse
from qosagent.hist import Histogram
from qosagent.latency import bpfmaps as bm
from qosagent.latency import datapath, export, reading, slots
from qosagent.latency.model import SHARED_TIER, LatencyPart
from qosagent.tenants import UNMATCHED_ID, tenant_id

TIERS = {"gold": {"slo_p99": "20ms", "weight": 10}, "bronze": {"slo_p99": "5s", "weight": 1}}


def cfg(tenants: dict[str, str], tiers: dict | None = None):
    return parse({"tiers": tiers or TIERS,
                  "tenants": [{"name": n, "tier": t, "match": {"ports": [9000 + i]}}
                              for i, (n, t) in enumerate(tenants.items())]}, "t")


def test_rows_leave_room_for_reloads() -> None:
    assert bm.runq_rows_for(3) == 10  # the shared row, "none", three tiers, and as many again
    assert bm.runq_rows_for(0) == bm.MIN_RUNQ_ROWS


def test_each_tier_has_a_row_after_the_shared_one_and_each_slot_its_tiers_row() -> None:
    m = slots.plan(cfg({"a": "gold", "b": "bronze", "c": "gold"}), {}, 8, {}, 6)
    assert m.runq_rows == {"bronze": 1, "gold": 2, "none": 3}  # unmatched traffic's tier is "none"
    assert bm.RUNQ_SHARED not in m.runq_rows.values()
    by_tenant = {tid: m.slot_rows[slot] for tid, slot in m.slots.items()}
    assert by_tenant == {UNMATCHED_ID: 3, tenant_id("a"): 2, tenant_id("b"): 1, tenant_id("c"): 2}


def test_a_reload_keeps_each_tiers_row_moves_a_tenants_slot_and_refuses_when_no_row_is_free() -> None:
    first = slots.plan(cfg({"a": "gold", "b": "bronze"}), {}, 8, {}, 5)
    # b moves to a new tier, silver: gold and bronze keep their rows (bronze's waits since start stay reported),
    # silver takes a free one, and b's slot now says silver's.
    tiers = {**TIERS, "silver": {"slo_p99": "1s", "weight": 5}}
    again = slots.plan(cfg({"a": "gold", "b": "silver"}, tiers), first.slots, 8, first.runq_rows, 5)
    assert again.runq_rows == {**first.runq_rows, "silver": 4}
    assert again.slot_rows[again.slots[tenant_id("b")]] == 4
    assert again.slots == first.slots
    # A removed tenant keeps its slot, which no tier's row claims any more: the shared row.
    gone = slots.plan(cfg({"a": "gold"}), first.slots, 8, first.runq_rows, 5)
    assert first.slots[tenant_id("b")] in gone.slots.values()
    assert first.slots[tenant_id("b")] not in gone.slot_rows
    with pytest.raises(ValueError, match="rows for 4 tiers"):
        copper = {**tiers, "copper": {"slo_p99": "1s", "weight": 2}}
        slots.plan(cfg({"a": "gold", "b": "silver", "c": "copper"}, copper), again.slots, 8, again.runq_rows, 5)


def test_without_the_run_queue_probes_no_row_is_planned_and_no_tier_is_refused() -> None:
    many = {f"t{i}": {"slo_p99": "1s", "weight": 1} for i in range(20)}
    m = slots.plan(cfg({f"x{i}": f"t{i}" for i in range(20)}, many), {}, 64, {}, 0)
    assert m.runq_rows == {} and m.slot_rows == {}


def hist(*waits_us: int) -> Histogram:
    return Histogram.of([w * 1000 for w in waits_us])


NAMES = {bm.RUNQ_SHARED: SHARED_TIER, 1: "bronze", 2: "gold"}


def changes(runq: dict[int, Histogram] | None) -> bm.Changes:
    return bm.Changes({}, runq, 0)


def test_the_windows_are_per_row_by_tier_name_and_every_process_is_their_sum() -> None:
    view = reading.Tenants(1.0)
    view.update(0.0, changes(None), "ttft")  # the first tick: the windows start
    view.update(0.2, changes({2: hist(10, 20), 1: hist(5000)}), "ttft")
    rq = view.runqueue(NAMES)
    assert rq.tiers == {"bronze": hist(5000), "gold": hist(10, 20)}
    assert rq.total == hist(10, 20, 5000) and rq.window.count == 3
    # Later: gold waits more, and a process serving both tiers waits; bronze is idle.
    view.update(0.5, changes({2: hist(10, 20, 30), bm.RUNQ_SHARED: hist(700)}), "ttft")
    rq = view.runqueue(NAMES)
    assert set(rq.tiers) == {"bronze", "gold", SHARED_TIER}
    assert rq.total == hist(10, 20, 30, 700, 5000)
    # Past a window: each row's window is what it gained since the checkpoint a window ago, the sum the rows'.
    for t in (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7):
        view.update(t, changes({2: hist(10, 20, 30, 40)} if t == 1.7 else None), "ttft")
    rq = view.runqueue(NAMES)
    assert rq.tiers_window["gold"] == hist(40) and rq.tiers_window["bronze"].count == 0
    assert rq.tiers_window[SHARED_TIER].count == 0
    assert rq.window == hist(40)


def test_the_view_is_kept_while_nothing_moved() -> None:
    view = reading.Tenants(1.0)
    view.update(0.0, changes({2: hist(10)}), "ttft")
    first = view.runqueue(NAMES)
    view.update(0.01, changes(None), "ttft")  # no checkpoint, no row read
    assert view.runqueue(NAMES) is first
    assert view.runqueue({**NAMES}) is not first  # a reload's names: made again


def test_status_and_render_show_every_process_and_each_tier() -> None:
    gold, shared, bronze = hist(10, 20, 30), hist(900), hist(4000, 8000)
    tiers = {"gold": gold, "bronze": bronze, SHARED_TIER: shared}
    part = LatencyPart(1.0, {}, gold + shared + bronze, gold + shared + bronze, tiers, tiers)
    st = export.status(part, {}, "ttft", 0.99)
    assert st["runqueue"]["count"] == st["runqueue_total"]["count"] == 6
    assert {t: q["count"] for t, q in st["runqueue_tiers"].items()} == {"gold": 3, "bronze": 2, SHARED_TIER: 1}
    assert st["runqueue_tiers_total"]["gold"]["p99"] == gold.quantile(0.99)
    text = export.render(st)
    assert re.search(r"^run-queue latency of serving processes: .*\(6 waits\)$", text, re.M), text
    assert re.search(r"^  tier gold\s+p50 0\.0\d\d .*\(3 waits\)$", text, re.M), text
    assert re.search(r"^  serving several tiers\s+p50 0\.9\d\d .*\(1 waits\)$", text, re.M), text


def test_the_runqueue_family_has_a_series_per_tier_that_sum_to_every_process() -> None:
    gold, shared = hist(10, 20), hist(900)
    part = LatencyPart(1.0, {}, gold + shared, gold + shared, {"gold": gold, SHARED_TIER: shared}, {})
    fam = next(f for f in export.families(part, 3, "ttft", 0.99) if f.name == "qosagent_latency_runqueue_seconds")
    counts = {s.labels["tier"]: s.value for s in fam.samples if s.name.endswith("_count")}
    assert counts == {"gold": 2, SHARED_TIER: 1}
    assert sum(counts.values()) == (gold + shared).count
    # Without the run-queue probes, no family at all (not an empty one per tier).
    assert not [f for f in export.families(LatencyPart(1.0, {}), 3, "ttft", 0.99)
                if f.name == "qosagent_latency_runqueue_seconds"]


class _Recorded:
    """A map of the loaded program as write() uses it, each write logged in one list, in order."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name, self.log = name, log

    def key(self, **f: int) -> tuple:
        return tuple(f.values())

    def value(self, **f: int) -> int:
        return next(iter(f.values()))

    def update(self, k: int, v: int) -> None:
        self.log.append((self.name, k, v))


def test_a_reload_writes_new_rows_before_the_slots_resolve_and_resets_removed_ones_after(monkeypatch) -> None:
    """A removed gold tenant's slot must read gold's row while lat_slots and the port and network maps can still
    resolve its connections to it: reset first, a process serving it and another gold tenant would be marked as
    serving several tiers, for good. An added tenant's slot must have its row before lat_slots gives it out."""
    log: list[tuple] = []
    maps = {n: _Recorded(n, log) for n in ("lat_slot_tier", "lat_slots", "tracked_ports", "lat_mux_ports",
                                            "tenant_cidrs")}
    monkeypatch.setattr(datapath, "sync", lambda m, _entries: log.append((m.name,)))
    monkeypatch.setattr(datapath, "sync_cidrs", lambda m, _cidrs: log.append((m.name,)))
    monkeypatch.setattr(datapath.Datapath, "_plan_reads", lambda self: None)
    dp = object.__new__(datapath.Datapath)
    dp.prog = SimpleNamespace(map=maps.__getitem__)  # type: ignore[assignment]
    dp._ports = SimpleNamespace(sync=lambda _p: log.append(("tenant_ports",)))  # type: ignore[assignment]
    dp.slots, dp.runq_rows = {0: 0, 11: 1, 22: 2}, {"none": 1, "gold": 2}
    dp.slot_rows = {0: 1, 1: 2, 2: 2}  # slots 1 and 2: two gold tenants
    m = SimpleNamespace(slots={0: 0, 11: 1, 33: 3}, runq_rows={"none": 1, "gold": 2, "bronze": 3},
                        slot_rows={0: 1, 1: 2, 3: 3}, tracked=(), mux=(), ports={}, cidrs=())
    dp.write(m)  # type: ignore[arg-type]
    assert log == [("lat_slot_tier", 3, 3), ("lat_slots",), ("tracked_ports",), ("lat_mux_ports",),
                   ("tenant_ports",), ("tenant_cidrs",), ("lat_slot_tier", 2, bm.RUNQ_SHARED)]
    assert dp.slot_rows == {0: 1, 1: 2, 3: 3}
