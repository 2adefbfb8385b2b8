"""The fleet capability's tick without etcd: shares chosen from what the reporter saw, written through quota's
FleetWriter with their lease's end, demand handed back for the next report, and the audit only on a change."""

from __future__ import annotations

import time
from typing import Any, Mapping

from qosagent.capability import AgentContext
from qosagent.config import parse
from qosagent.fleet.agent import Seen
from qosagent.fleet.records import Want
from qosagent.fleet.capability import Fleet
from qosagent.gpu.fake import FakeBackend
from qosagent.hostfs import HostFS
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.snapshot import Snapshot
from qosagent.tenants import FLEET_NO_END, TenantLimit


class Writer:
    def __init__(self) -> None:
        self.shares: dict[str, tuple[TenantLimit, int]] = {}

    def set_shares(self, shares: Mapping[str, tuple[TenantLimit, int]]) -> None:
        self.shares = dict(shares)


class Reporter:
    node = "n1"

    def __init__(self) -> None:
        self.state = Seen()
        self.wants: dict[str, Want] = {}

    def seen(self) -> Seen:
        return self.state

    def offer(self, wants: Mapping[str, Want]) -> None:
        self.wants = dict(wants)


def _fleet() -> tuple[Fleet, Writer, Reporter]:
    cfg = parse({"quota": {"enabled": True},
                 "fleet": {"enabled": True, "expected_nodes": 4, "lease": "5s", "report_interval": "1s"},
                 "tenants": [{"name": "a", "tier": "gold", "match": {"ports": [8000]},
                              "quota": {"fleet_rps": 400, "fleet_burst": 40}}]}, "test")
    ctx = AgentContext(config=cfg, hostfs=HostFS("/"), gpu=FakeBackend.preset("h200x8"))
    w = Writer()
    ctx.services["quota.fleet"] = w
    f = Fleet(ctx)
    r = Reporter()
    f.reporter = r  # type: ignore[assignment]
    return f, w, r


def _tick(f: Fleet, admitted: float, dropped: float) -> list[Any]:
    q = QuotaPart(tenants={"a": TenantQuota("a", "gold", None, None, 0, 0, admitted_rps=admitted,
                                            dropped_rps=dropped)})
    snap = Snapshot.build(1, time.monotonic(), time.time(), {"fleet": f.collect(), "quota": q})
    decisions = f.decide(snap)
    f.apply(decisions)
    return decisions


def test_without_a_grant_the_safe_share_is_written_without_an_end_and_reported_as_held() -> None:
    f, w, r = _fleet()
    d = _tick(f, 80, 20)
    assert [x.action for x in d] == ["share"] and d[0].inputs["source"] == "safe"
    lim, until = w.shares["a"]
    assert lim == TenantLimit(100, 10) and until == FLEET_NO_END
    assert r.wants == {"a": Want(100, 100)}
    assert _tick(f, 80, 20) == []  # nothing changed: nothing audited


def test_a_live_grant_is_written_with_its_lease_end_on_the_monotonic_clock() -> None:
    f, w, r = _fleet()
    renewed = time.monotonic()
    r.state = Seen(grant={"a": 300.0}, renewed_at=renewed, etcd_up=True)
    d = _tick(f, 250, 90)
    assert d[0].inputs["source"] == "lease" and d[0].new == 300
    lim, until = w.shares["a"]
    assert lim == TenantLimit(300, 30) and until == int((renewed + 5.0) * 1e9)
    assert r.wants["a"] == Want(340, 300)
    st = f.status(Snapshot.build(2, 0, 0, {"fleet": f.settled(f.collect())}))
    assert st["tenants"][0]["source"] == "lease" and st["tenants"][0]["node_rps"] == 300
    assert "FLEET node n1" in Fleet.render(st)
