"""The allocator's pure decision: max-min fairness, per-node minimums, staging under the quota, the slack bound,
and records read back from etcd (absurd, malformed, foreign)."""

from __future__ import annotations

import json
import math
import random

import pytest

from qosagent.fleet import records
from qosagent.fleet.alloc import MIN_NODE_RPS, Want, allocate, level, minimum, split, stage


def test_the_water_level_is_max_min_fair() -> None:
    top = level(100, [10, 50, 80])
    assert top == pytest.approx(45)  # 10 + 45 + 45
    assert level(100, [10, 20]) == math.inf  # every want met, the rest left


def test_split_gives_every_node_its_minimum_and_spreads_what_demand_leaves() -> None:
    m = minimum(300, 3)
    target, short = split(300, [290, 0, 0])
    assert not short and target[1] == target[2] == pytest.approx(m)
    assert sum(target) == pytest.approx(300)
    a, b, c = split(300, [50, 20, 0])[0]
    assert a + b + c == pytest.approx(300)  # headroom spread by demand: a and b above theirs
    assert a > 50 and b > 20 and c == pytest.approx(m)
    assert (a - 50) / (b - 20) == pytest.approx(50 / 20, rel=0.1)
    assert split(300, [0, 0])[0] == [150, 150]


def test_demand_above_the_level_is_cut_max_min() -> None:
    # 100 over four nodes, minimum 1.25 each: the two small demands are met, the big two share the rest evenly.
    target, _ = split(100, [10, 5, 200, 300])
    assert target[0] == pytest.approx(10) and target[1] == pytest.approx(5)
    assert target[2] == pytest.approx(target[3]) == pytest.approx(42.5)


def test_a_quota_below_nodes_times_the_minimum_is_split_evenly_and_flagged() -> None:
    target, short = split(2, [10, 0, 5])
    assert short and target == pytest.approx([2 / 3] * 3)
    assert MIN_NODE_RPS * 3 > 2


def test_stage_lowers_at_once_and_raises_only_into_what_is_free() -> None:
    # Everyone on the safe share (100 each of 300), demand all on a: the first round only lowers b and c.
    target = [290.0, 5.0, 5.0]
    grants, committed = stage(300, target, [100, 100, 100])
    assert grants == [100, 5, 5] and committed == 300
    # Once b and c report their lower rate, a gets the rest.
    grants, committed = stage(300, target, [100, 5, 5])
    assert grants == [290, 5, 5] and committed == 300


def test_stage_shares_what_is_free_in_proportion_when_short() -> None:
    grants, committed = stage(100, [60.0, 40.0], [30, 10])
    assert grants == [60, 40] and committed == 100
    grants, _ = stage(100, [60.0, 40.0], [50, 40])
    assert grants == [60, 40]
    grants, committed = stage(100, [80.0, 20.0], [50, 40])  # b must come down before a can go up
    assert grants == [60, 20] and committed == 100


def test_nodes_over_the_quota_already_get_decreases_only() -> None:
    # More nodes on their safe share than expected: held sums above the quota; nobody is raised until it is not.
    grants, _ = stage(300, [200.0, 50.0, 25.0, 25.0], [100] * 4)
    assert grants == [100, 50, 25, 25]


@pytest.mark.parametrize("seed", range(20))
def test_the_committed_sum_never_exceeds_the_quota_over_random_rounds(seed: int) -> None:
    """Agents that apply their grant (held := grant) on random rounds, demand jumping around: sum over nodes of
    max(held, granted) stays within the quota every round, and with demand held still the grants reach target."""
    rng = random.Random(seed)
    quota = rng.choice([10.0, 300.0, 5000.0])
    nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
    held = {n: quota / len(nodes) for n in nodes}  # all on the safe share, expected_nodes = len(nodes)
    demand: dict[str, float] = {}
    for step in range(60):
        if step < 40:  # then demand holds still
            demand = {n: rng.choice([0, rng.uniform(0, quota), quota * 5]) for n in nodes}
        r = allocate({"t": quota}, {n: {"t": Want(min(demand[n], quota), held[n])} for n in nodes})
        t = r.tenants["t"]
        assert t.committed <= quota + 1e-6
        assert sum(max(held[n], t.grants[n]) for n in nodes) <= quota + 1e-6
        for n in nodes:
            if rng.random() < 0.7:  # this node read its grant this round
                held[n] = t.grants[n]
    assert t.grants == pytest.approx(t.target)


def test_tenants_are_allocated_each_against_its_own_quota_and_unmentioned_ones_get_a_minimum() -> None:
    r = allocate({"a": 100, "b": 10}, {"n1": {"a": Want(100, 50)}, "n2": {"b": Want(3, 5)}})
    assert set(r.tenants) == {"a", "b"}
    assert set(r.tenants["a"].grants) == {"n1", "n2"}
    assert r.by_node()["n2"]["a"] == pytest.approx(minimum(100, 2))


def test_reports_with_absurd_demand_are_clamped_to_the_quota() -> None:
    raw = records.encode_report("n1", {"a": Want(1e12, 5)})
    rep, foreign = records.decode_report("n1", raw, {"a": 100})
    assert rep.tenants["a"] == (100, 5) and not foreign


@pytest.mark.parametrize("raw, why", [
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"v": 99, "node": "n1", "tenants": {}}).encode(), "version"),
    (json.dumps({"v": 1, "node": "other", "tenants": {}}).encode(), "under the key"),
    (json.dumps({"v": 1, "node": "n1", "tenants": []}).encode(), "no tenants"),
    (json.dumps({"v": 1, "node": "n1", "tenants": {"a": [-1, 0]}}).encode(), "finite"),
    (b'{"v": 1, "node": "n1", "tenants": {"a": [NaN, 0]}}', "NaN is not a rate"),
    (b'{"v": 1, "node": "n1", "tenants": {"a": [1, Infinity]}}', "Infinity is not a rate"),
    (json.dumps({"v": 1, "node": "n1", "tenants": {"a": ["lots", 0]}}).encode(), "finite"),
    (json.dumps({"v": 1, "node": "n1", "tenants": {"a": [True, 0]}}).encode(), "finite"),
    (json.dumps({"v": 1, "node": "n1", "tenants": {"a": {"demand": 1, "held": 0}}}).encode(), "expected"),
    (json.dumps({"v": 1, "node": "n1", "tenants": {"a": [1]}}).encode(), "expected"),
])
def test_malformed_reports_are_refused_with_a_reason(raw: bytes, why: str) -> None:
    with pytest.raises(records.Malformed, match=why):
        records.decode_report("n1", raw, {"a": 100})


def test_foreign_tenants_in_a_report_are_named_and_skipped() -> None:
    raw = records.encode_report("n1", {"a": Want(5, 5), "zzz": Want(1, 1)})
    rep, foreign = records.decode_report("n1", raw, {"a": 100})
    assert set(rep.tenants) == {"a"} and foreign == ["zzz"]


def test_grants_round_trip_and_bad_ones_are_refused() -> None:
    g = records.decode_grant(records.encode_grant("alloc-1", 7, {"a": 12.3456}))
    assert g.leader == "alloc-1" and g.round == 7 and g.tenants == {"a": 12.346}
    with pytest.raises(records.Malformed):
        records.decode_grant(b'{"v": 1, "round": 1, "tenants": {"a": Infinity}}')
    with pytest.raises(records.Malformed):
        records.decode_grant(b'{"v": 1, "tenants": {}}')
    assert not math.isnan(g.tenants["a"])
