"""Latency's tick as the part's numbers (qosagent/latency/reading.py): what moves the version the capability makes a
new part at, and what leaves it (a tick at rest rebuilds nothing and copies no tenant)."""

from __future__ import annotations

from qosagent.hist import Histogram
from qosagent.latency import bpfmaps as bm
from qosagent.latency.reading import Tenants
from qosagent.rowmap import RowMap
from qosagent.tenants import UNMATCHED_ID, TenantInfo

TABLE = {i: TenantInfo(i, f"t{i}", "silver", 0, 1.0) for i in range(1, 101)}
QUIET = bm.Changes({}, None, 0)


def sent(n: int) -> bm.Cumulative:
    h = Histogram.of([1_000_000] * n)
    return bm.Cumulative((h,) * bm.KINDS, {bm.C_STARTED: n})


def test_a_tick_at_rest_moves_nothing_and_a_window_draining_does() -> None:
    view = Tenants(1.0)
    view.configure(TABLE, TABLE, 1.0)
    view.update(0.0, QUIET, "response")  # every tenant, once
    first, version = dict(view.tenants), view.version
    for i in range(1, 20):
        view.update(i / 10, QUIET, "response")
    assert view.version == version and all(view.tenants[n] is t for n, t in first.items())
    view.update(2.0, bm.Changes({3: sent(5)}, None, 1), "response")
    assert view.version == version + 1 and view.tenants["t3"].requests == 5
    # t3's window holds requests: its rate moves with time, a new part each tick, until the window is empty.
    drained = []
    for i in range(1, 16):
        before = view.version
        view.update(2.0 + i / 10, QUIET, "response")
        drained.append((view.version != before, view.tenants["t3"].response_window.count))
    assert drained[0] == (True, 5) and drained[-1] == (False, 0)
    assert [moved for moved, _ in drained].index(False) == [n for _, n in drained].index(0) + 1
    # The run queue's row read moves it too (its window is in the part).
    before = view.version
    view.update(4.0, bm.Changes({}, {bm.RUNQ_SHARED: Histogram.of([1_000])}, 1), "response")
    assert view.version == before + 1


def test_a_tick_that_changes_one_tenant_copies_no_other_tenants_row() -> None:
    """Counted: the tenants and windows a part holds are the view's RowMaps, not copies: a tick that reads t3 puts
    t3's row and window alone into new mappings (before, each such tick copied all 100 of both into the part), while
    the earlier versions keep what they held. It is t3 every tick: with different tenants tick to tick the rows
    changed since the base add up (test_rowmap.py)."""
    view = Tenants(1.0)
    view.configure(TABLE, TABLE, 1.0)
    view.update(0.0, QUIET, "response")
    first = view.tenants
    for i in range(1, 4):
        before = RowMap.copied
        view.update(i / 100, bm.Changes({3: sent(i)}, None, 1), "response")
        assert RowMap.copied - before == 2  # t3's row and its window
        assert view.tenants["t3"].requests == i and view.windows["t3"][1].count == i
    assert first["t3"].requests == 0 and all(view.tenants[n] is t for n, t in first.items() if n != "t3")
    assert list(view.tenants) == list(first) and "t3" in view.busy


def test_only_a_configured_tenants_row_or_window_moving_is_news_to_a_decision() -> None:
    """rows_moved (the capability's quiet): the unmatched tenant's requests (the agent's own reads of a server's
    metrics on its API port) and the run queue move the version, a new part for metrics, but no decision's input."""
    table = {**TABLE, UNMATCHED_ID: TenantInfo(UNMATCHED_ID, "unmatched", "none", 0, 0.0)}
    view = Tenants(1.0)
    view.configure(table, table, 1.0)
    view.update(0.0, QUIET, "response")
    assert view.rows_moved  # the first: every tenant
    moves = []
    for i in range(1, 30):  # unmatched requests every 0.5 s, the run queue every tick
        before = view.version
        tenants = {UNMATCHED_ID: sent(i // 5)} if i % 5 == 0 else {}
        view.update(i / 10, bm.Changes(tenants, {bm.RUNQ_SHARED: Histogram.of([1_000] * i)}, 1), "response")
        moves.append((view.version != before, view.rows_moved))
    assert all(v for v, _ in moves) and not any(m for _, m in moves)
    view.update(3.0, bm.Changes({3: sent(1)}, None, 1), "response")
    assert view.rows_moved
    # t3's window holds its request: news every tick until it is empty, then quiet.
    draining = []
    for i in range(1, 16):
        view.update(3.0 + i / 10, QUIET, "response")
        draining.append(view.rows_moved)
    assert draining[0] and not draining[-1]
