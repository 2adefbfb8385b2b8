"""Quota's tick as the part (qosagent/quota/reading.py), from reads that hold only the slots whose generation moved:
idle tenants are not rebuilt, rates over the last second drain without a read, and every tenant is rebuilt when the
limits in force may have changed."""

from __future__ import annotations

from qosagent.config import parse
from qosagent.quota.datapath import Reading
from qosagent.quota.layout import QuotaLimit
from qosagent.quota.reading import Tenants
from qosagent.tenants import TenantLimit, baseline, tenant_id, tenant_table

CFG = parse({"tenants": [{"name": f"t{i}", "tier": "silver", "match": {"ports": [18000 + i]},
                          "quota": {"rps": 100, "burst": 10}} for i in range(100)]}, "test")
TABLE = {tid: info for tid, info in tenant_table(CFG).items() if tid}
SPECS = baseline(CFG)
BUSY = tenant_id("t3")


def read(t: float, counts: dict[int, tuple[int, int, int, int]]) -> Reading:
    ns = int(t * 1e9)
    limits = {tid: QuotaLimit() for tid in TABLE}
    return Reading(ns, counts, {}, limits, {tid: (0, 0) for tid in counts}, ns, len(counts))


def test_only_tenants_that_moved_are_rebuilt_and_rates_drain_unread() -> None:
    view = Tenants()
    view.update(read(0.0, {tid: (0, 0, 0, 0) for tid in TABLE}), TABLE, SPECS, {}, {}, 1.0)  # the first read: all
    first = dict(view.tenants)
    assert len(first) == 100
    for i in range(1, 11):  # t3 admits 5 a tick for a second
        view.update(read(i / 10, {BUSY: (5 * i, 0, 0, 0)}), TABLE, SPECS, {}, {}, 1.0)
    assert view.tenants["t3"].admitted == 50 and view.tenants["t3"].admitted_rps == 50.0
    assert all(view.tenants[n] is first[n] for n in first if n != "t3")  # the idle ones: the same objects
    # t3 stops: nothing is read, its rate drains to 0 within a second and a step.
    for i in range(11, 24):
        view.update(read(i / 10, {}), TABLE, SPECS, {}, {}, 1.0)
    assert view.tenants["t3"].admitted == 50 and view.tenants["t3"].admitted_rps == 0.0
    # An override of one tenant may change what is in force: every tenant is worked out again, once.
    before = dict(view.tenants)
    view.update(read(2.4, {}), TABLE, SPECS, {"t7": TenantLimit(10, 1)}, {}, 1.0)
    assert view.tenants["t7"].limit == TenantLimit(10, 1)
    assert view.tenants["t8"] is not before["t8"] and view.tenants["t8"] == before["t8"]
    again = dict(view.tenants)
    view.update(read(2.5, {}), TABLE, SPECS, {"t7": TenantLimit(10, 1)}, {}, 1.0)
    assert view.tenants["t8"] is again["t8"]


def test_the_heartbeat_is_written_five_times_per_timeout_not_every_tick() -> None:
    from qosagent.capability import AgentContext
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.quota.capability import Quota, heartbeat_every

    now = [0.0]
    beats: list[float] = []

    class Datapath:
        def heartbeat(self) -> None:
            beats.append(now[0])

    cfg = parse({"quota": {"enabled": True, "heartbeat_timeout": "2500ms"}}, "test")
    q = Quota(AgentContext(config=cfg, hostfs=HostFS("/"), gpu=NoGpu("test"), clock=lambda: now[0]))
    q.datapath = Datapath()  # type: ignore[assignment]
    q._follow = lambda: None  # type: ignore[method-assign]  # the follow is test_quota_follow's
    for i in range(32):  # 4 s of ticks 125 ms apart
        now[0] = i / 8
        q.maintain()
    assert beats == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert heartbeat_every(5.0) == 1.0  # the default timeout: once a second
