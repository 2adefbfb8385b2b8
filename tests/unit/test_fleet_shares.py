"""The agent's pure choice of a tenant's share, and the fleet config's checks."""

from __future__ import annotations

import pytest

from qosagent.config import ConfigError, parse
from qosagent.fleet.agent import Seen
from qosagent.fleet.model import shares
from qosagent.fleet.quotas import FleetQuota, fleet_quotas, node_burst

Q = {"a": FleetQuota(300, None), "b": FleetQuota(90, 30)}


def test_a_live_grant_holds_until_its_lease_less_one_tick_then_the_safe_share() -> None:
    seen = Seen(grant={"a": 250.0, "b": 10.0}, renewed_at=100.0)
    s = shares(Q, seen, 104.0, lease=5.0, safe_share=1 / 3, margin=0.1)
    assert s["a"].source == "lease" and s["a"].node_rps == 250 and s["a"].until == 105.0
    assert s["a"].lease_age_s == pytest.approx(4.0)
    s = shares(Q, seen, 104.95, lease=5.0, safe_share=1 / 3, margin=0.1)
    assert s["a"].source == "safe" and s["a"].node_rps == pytest.approx(100) and s["a"].until is None


def test_no_grant_yet_or_a_tenant_the_grant_does_not_name_is_on_the_safe_share() -> None:
    s = shares(Q, Seen(), 1.0, lease=5.0, safe_share=0.5, margin=0.1)
    assert {t.source for t in s.values()} == {"safe"} and s["b"].node_rps == 45 and s["a"].lease_age_s is None
    s = shares(Q, Seen(grant={"a": 1.0}, renewed_at=0.5), 1.0, lease=5.0, safe_share=0.5, margin=0.1)
    assert s["a"].source == "lease" and s["b"].source == "safe"


def test_a_grant_above_the_fleet_quota_is_held_to_it() -> None:
    s = shares(Q, Seen(grant={"b": 1e6}, renewed_at=0.0), 0.0, lease=5.0, safe_share=0.5, margin=0.1)
    assert s["b"].node_rps == 90


def test_a_clock_that_runs_backwards_does_not_make_a_lease_younger() -> None:
    # The reporter's clock is monotonic; even so, an age below zero (a mock or a bug) reads as age 0, not more life.
    s = shares(Q, Seen(grant={"a": 5.0}, renewed_at=10.0), 9.0, lease=5.0, safe_share=0.5, margin=0.1)
    assert s["a"].lease_age_s == 0.0 and s["a"].until == 15.0


def test_node_burst_is_the_fleet_burst_split_like_the_rate() -> None:
    assert node_burst(FleetQuota(90, 30), 45) == 15
    assert node_burst(FleetQuota(90, 30), 0.1) == 1
    assert node_burst(FleetQuota(300, None), 250) == 25


def _cfg(fleet: dict, quota: dict | None = None, tier_quota: dict | None = None):  # type: ignore[no-untyped-def]
    tiers = {"gold": {"slo_p99": "120ms", "weight": 10, **({"quota": tier_quota} if tier_quota else {})}}
    return parse({"quota": {"enabled": True}, "fleet": fleet, "tiers": tiers,
                  "tenants": [{"name": "a", "tier": "gold", "match": {"ports": [8000]},
                               **({"quota": quota} if quota else {})}]}, "test")


def test_fleet_quotas_come_from_the_tenant_else_its_tier() -> None:
    cfg = _cfg({"enabled": True, "expected_nodes": 3}, tier_quota={"fleet_rps": 50, "fleet_burst": 5})
    assert fleet_quotas(cfg) == {"a": FleetQuota(50, 5)}
    assert cfg.fleet.share_when_unleased == pytest.approx(1 / 3)
    cfg = _cfg({"enabled": True, "safe_share": 0.25}, quota={"fleet_rps": 10}, tier_quota={"fleet_rps": 50})
    assert fleet_quotas(cfg) == {"a": FleetQuota(10, None)} and cfg.fleet.share_when_unleased == 0.25


@pytest.mark.parametrize("fleet, why", [
    ({"enabled": True}, "expected safe_share or expected_nodes"),
    ({"enabled": True, "expected_nodes": 2, "lease": "1s", "report_interval": "1s"}, "at least twice"),
    ({"enabled": True, "expected_nodes": 2, "endpoints": []}, "at least one"),
    ({"enabled": True, "expected_nodes": 2, "endpoints": ["127.0.0.1:2379"]}, "http"),
    ({"enabled": True, "expected_nodes": 2, "engine": "redis"}, "etcd"),
    ({"enabled": True, "safe_share": 1.5}, "less than or equal"),
])
def test_bad_fleet_configs_are_refused_naming_the_key(fleet: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        _cfg(fleet)


def test_fleet_needs_quota() -> None:
    with pytest.raises(ConfigError, match="needs quota.enabled"):
        parse({"fleet": {"enabled": True, "expected_nodes": 2}}, "test")
