"""The allocator's pure decision: max-min fairness, per-node minimums, staging under the quota, the slack bound,
and records read back from etcd (absurd, malformed, foreign)."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest

from qosagent.fleet import records
from qosagent.fleet.alloc import MIN_NODE_RPS, Ledger, allocate, level, minimum, pools, split, stage
from qosagent.fleet.records import Want


def one_level(total: float, wants: list[float]) -> float:
    return float(level(np.array([total]), np.array(wants, dtype=float)[:, None])[0])


def one_split(quota: float, demand: list[float]) -> tuple[list[float], bool]:
    """split for one tenant (a column of one)."""
    target, short = split(np.array([quota]), np.array(demand, dtype=float)[:, None])
    return target[:, 0].tolist(), bool(short[0])


def one_stage(quota: float, target: list[float], held: list[float]) -> tuple[list[float], float]:
    grants, committed = stage(np.array([quota]), np.array(target, dtype=float)[:, None],
                              np.array(held, dtype=float)[:, None])
    return grants[:, 0].tolist(), float(committed[0])


def test_the_water_level_is_max_min_fair() -> None:
    top = one_level(100, [10, 50, 80])
    assert top == pytest.approx(45)  # 10 + 45 + 45
    assert one_level(100, [10, 20]) == math.inf  # every want met, the rest left


def test_split_gives_every_node_its_minimum_and_spreads_what_demand_leaves() -> None:
    m = minimum(300, 3)
    target, short = one_split(300, [290, 0, 0])
    assert not short and target[1] == target[2] == pytest.approx(m)
    assert sum(target) == pytest.approx(300)
    a, b, c = one_split(300, [50, 20, 0])[0]
    assert a + b + c == pytest.approx(300)  # headroom spread by demand: a and b above theirs
    assert a > 50 and b > 20 and c == pytest.approx(m)
    assert (a - 50) / (b - 20) == pytest.approx(50 / 20, rel=0.1)
    assert one_split(300, [0, 0])[0] == [150, 150]


def test_demand_above_the_level_is_cut_max_min() -> None:
    # 100 over four nodes, minimum 1.25 each: the two small demands are met, the big two share the rest evenly.
    target, _ = one_split(100, [10, 5, 200, 300])
    assert target[0] == pytest.approx(10) and target[1] == pytest.approx(5)
    assert target[2] == pytest.approx(target[3]) == pytest.approx(42.5)


def test_a_quota_below_nodes_times_the_minimum_is_split_evenly_and_flagged() -> None:
    target, short = one_split(2, [10, 0, 5])
    assert short and target == pytest.approx([2 / 3] * 3)
    assert MIN_NODE_RPS * 3 > 2


def test_stage_lowers_at_once_and_raises_only_into_what_is_free() -> None:
    # Everyone on the safe share (100 each of 300), demand all on a: the first round only lowers b and c.
    target = [290.0, 5.0, 5.0]
    grants, committed = one_stage(300, target, [100, 100, 100])
    assert grants == [100, 5, 5] and committed == 300
    # Once b and c report their lower rate, a gets the rest.
    grants, committed = one_stage(300, target, [100, 5, 5])
    assert grants == [290, 5, 5] and committed == 300


def test_stage_shares_what_is_free_in_proportion_when_short() -> None:
    grants, committed = one_stage(100, [60.0, 40.0], [30, 10])
    assert grants == [60, 40] and committed == 100
    grants, _ = one_stage(100, [60.0, 40.0], [50, 40])
    assert grants == [60, 40]
    grants, committed = one_stage(100, [80.0, 20.0], [50, 40])  # b must come down before a can go up
    assert grants == [60, 20] and committed == 100


def test_nodes_over_the_quota_already_get_decreases_only() -> None:
    # More nodes on their safe share than expected: held sums above the quota; nobody is raised until it is not.
    grants, _ = one_stage(300, [200.0, 50.0, 25.0, 25.0], [100] * 4)
    assert grants == [100, 50, 25, 25]


def test_tenants_split_and_staged_together_decide_as_each_alone() -> None:
    """The columns of one call are independent: each tenant against its own quota, as if alone."""
    rng = random.Random(7)
    quotas = [10.0, 300.0, 2.0, 5000.0]
    demand = [[rng.choice([0.0, rng.uniform(0, q), 5 * q]) for q in quotas] for _ in range(6)]
    held = [[rng.uniform(0, q / 4) for q in quotas] for _ in range(6)]
    target, short = split(np.array(quotas), np.array(demand))
    grants, committed = stage(np.array(quotas), target, np.array(held))
    for j, q in enumerate(quotas):
        t1, s1 = one_split(q, [row[j] for row in demand])
        g1, c1 = one_stage(q, t1, [row[j] for row in held])
        assert target[:, j].tolist() == pytest.approx(t1) and bool(short[j]) == s1
        assert grants[:, j].tolist() == pytest.approx(g1) and committed[j] == pytest.approx(c1)


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
    rep, foreign = records.Reports({"a": 100}).decode("n1", raw)
    assert (rep.demand.tolist(), rep.held.tolist()) == ([100], [5]) and not foreign


def packed(magic: bytes = b"QFR", version: int = 2, node: bytes = b"n1", names: list[bytes] | None = None,
           count: int | None = None, rates: list[float] | None = None, tail: bytes = b"") -> bytes:
    """A report laid out field by field, each field free to be wrong."""
    names = [b"a"] if names is None else names
    block = b"\n".join(names)
    rates = [1.0] * (2 * len(names)) if rates is None else rates
    return (magic + bytes((version,)) + struct.pack("<H", len(node)) + node +
            struct.pack("<II", len(names) if count is None else count, len(block)) + block +
            struct.pack(f"<{len(rates)}d", *rates) + tail)


@pytest.mark.parametrize("raw, why", [
    (b"", "not a packed record"),
    (b'{"v": 1, "node": "n1", "tenants": {"a": [1, 1]}}', "not a packed record"),  # the JSON of v1
    (packed(version=1), "version 1, expected 2"),
    (packed(magic=b"QFG"), "not a packed record"),  # a grant under a node's key
    (packed(node=b"other"), "under the key"),
    (packed(node=b"\xff"), "not UTF-8"),
    (packed(names=[b"a", b"a"]), "2 distinct names|1 distinct"),
    (packed(names=[b"a\xff"]), "not UTF-8"),
    (packed(count=3), "3 tenants announced"),
    (packed(rates=[-1.0, 0.0]), "tenants a: a rate that is not a finite number >= 0"),
    (packed(rates=[math.nan, 0.0]), "finite"),
    (packed(rates=[1.0, math.inf]), "finite"),
    (packed(rates=[1.0]), "truncated"),
    (packed(tail=b"x"), "1 bytes past the end"),
    (packed()[:7], "truncated"),
])
def test_malformed_reports_are_refused_with_a_reason(raw: bytes, why: str) -> None:
    with pytest.raises(records.Malformed, match=why):
        records.Reports({"a": 100}).decode("n1", raw)


def test_foreign_tenants_in_a_report_are_named_and_skipped_and_missing_ones_are_zero() -> None:
    dec = records.Reports({"a": 100, "b": 50})
    raw = records.encode_report("n1", {"a": Want(5, 4), "zzz": Want(1, 1)})
    for _ in range(2):  # the second from the cache of names blocks
        rep, foreign = dec.decode("n1", raw)
        assert (rep.demand.tolist(), rep.held.tolist()) == ([5, 0], [4, 0]) and foreign == ["zzz"]


def grant(leader: str, round_: int, tenants: list[str], rates: list[float]) -> bytes:
    """As the allocator writes one: the round's head, then the node's rates."""
    return records.grant_head(leader, round_) + records.names_block(tenants) + struct.pack(f"<{len(rates)}d", *rates)


def test_grants_round_trip_and_bad_ones_are_refused() -> None:
    g = records.decode_grant(grant("alloc-1", 7, ["a", "b"], [12.3456, 0.0]))
    assert g.leader == "alloc-1" and g.round == 7 and g.tenants == {"a": 12.3456, "b": 0.0}
    good = grant("alloc-1", 7, ["a"], [1.0])
    for bad in (good[:-1], good + b"\0", good[:-8] + struct.pack("<d", math.inf), b"QFR" + good[3:],
                b'{"v": 1, "round": 1, "tenants": {"a": 1}}'):
        with pytest.raises(records.Malformed):
            records.decode_grant(bad)


@pytest.mark.parametrize("seed", range(10))
def test_the_incremental_ledger_decides_as_a_fresh_allocation_and_names_every_grant_that_moved(seed: int) -> None:
    """The allocator's Ledger, fed only the reports that changed, grants what allocate() grants from scratch; the
    nodes it names are those whose grant differs from the round before (what the allocator rewrites)."""
    rng = random.Random(seed)
    quotas = {"a": 300.0, "b": 50.0, "c": 1000.0}
    weights = {"a": 10, "b": 10, "c": 1}
    capacity = rng.choice([None, 600.0, 200.0])
    ledger = Ledger(quotas, capacity, weights)
    reports: dict[str, dict[str, Want]] = {}
    before: dict[str, dict[str, float]] = {}
    for step in range(30):
        changed = {}
        for n in rng.sample([f"n{i}" for i in range(6)], rng.randint(0, 3)):
            changed[n] = {t: Want(rng.choice([0.0, rng.uniform(0, q)]), rng.uniform(0, q / 3))
                          for t, q in quotas.items() if rng.random() < 0.8}
        reports.update(changed)
        if step % 7 == 6 and reports:  # a node goes
            reports.pop(sorted(reports)[0])
        r, moved, _dirty = ledger.round(list(reports), {n: v for n, v in changed.items() if n in reports})
        fresh = allocate(quotas, reports, capacity, weights)
        for t in quotas:
            assert r.tenants[t].grants == pytest.approx(fresh.tenants[t].grants)
            assert r.tenants[t].pool == pytest.approx(fresh.tenants[t].pool)
        now = r.by_node()
        assert {n for n in now if now[n] != before.get(n)} <= moved
        before = now


def test_without_a_capacity_tenants_never_compete() -> None:
    r = allocate({"gold": 100.0, "bronze": 100.0}, {"n1": {"gold": Want(100, 50), "bronze": Want(100, 50)}})
    assert r.tenants["gold"].pool == r.tenants["bronze"].pool == 100


def test_pools_serve_the_heavier_tier_first_when_the_capacity_is_short() -> None:
    quotas = {"g1": 100.0, "g2": 100.0, "s": 100.0, "b": 100.0}
    weights = {"g1": 10, "g2": 10, "s": 5, "b": 1}
    demand = {"g1": 80.0, "g2": 500.0, "s": 100.0, "b": 100.0}
    # Two nodes: each tenant's floor is 2 x max(1, 5 % of 50) = 5.
    pool, short = pools(250, quotas, demand, 2, weights)
    assert not short and sum(pool.values()) == pytest.approx(250)
    assert pool["g1"] == pytest.approx(80) and pool["g2"] == pytest.approx(100)  # gold first, up to demand/quota
    assert pool["s"] == pytest.approx(250 - 180 - 5)  # silver gets what gold left, bronze keeps its floor
    assert pool["b"] == pytest.approx(5)
    # A capacity that fits every demand: each tier gets its demand, then headroom up to the quotas by weight.
    pool, _ = pools(395, quotas, {"g1": 10.0, "g2": 10.0, "s": 10.0, "b": 10.0}, 2, weights)
    assert pool["g1"] == pool["g2"] == pool["s"] == pytest.approx(100) and pool["b"] == pytest.approx(95)
    # Within a tier that does not fit: max-min fair by demand.
    pool, _ = pools(110, {"x": 100.0, "y": 100.0}, {"x": 20.0, "y": 200.0}, 2, {"x": 1, "y": 1})
    assert pool["x"] == pytest.approx(20) and pool["y"] == pytest.approx(90)


def test_a_capacity_below_every_floor_is_split_by_floors_and_flagged_never_zero() -> None:
    pool, short = pools(6, {"a": 100.0, "b": 300.0}, {"a": 100.0, "b": 300.0}, 3, {"a": 10, "b": 1})
    # Floors: a 3 x max(1, 5/3) = 5, b 3 x 5 = 15: the capacity of 6 in that proportion, bronze too.
    assert short and pool["a"] == pytest.approx(1.5) and pool["b"] == pytest.approx(4.5)
    r = allocate({"a": 100.0, "b": 300.0}, {f"n{i}": {"a": Want(50, 0), "b": Want(50, 0)} for i in range(3)},
                 capacity=6, weights={"a": 10, "b": 1})
    assert r.capacity_short and all(g > 0 for t in r.tenants.values() for g in t.grants.values())


@pytest.mark.parametrize("seed", range(20))
def test_the_sum_over_tenants_never_exceeds_the_capacity_while_tiers_trade_it(seed: int) -> None:
    """Demand moving between tiers and nodes, agents applying their grants on random rounds: the sum over every
    tenant and node of max(held, granted) stays within fleet.capacity_rps (each tenant's within its fleet_rps),
    and with demand held still the heavier tier ends up with what it asks for."""
    rng = random.Random(seed)
    quotas = {"gold": 400.0, "silver": 400.0, "bronze": 400.0}
    weights = {"gold": 10, "silver": 5, "bronze": 1}
    capacity = 600.0
    nodes = [f"n{i}" for i in range(rng.randint(2, 6))]
    held = {(n, t): capacity / len(nodes) / 3 for n in nodes for t in quotas}
    ledger = Ledger(quotas, capacity, weights)
    demand: dict[tuple[str, str], float] = {}
    for step in range(60):
        if step < 40:
            demand = {(n, t): rng.choice([0.0, rng.uniform(0, 200), 1000.0]) for n in nodes for t in quotas}
        if step == 40:
            demand = {(n, t): (300.0 if t != "bronze" else 500.0) / len(nodes) for n in nodes for t in quotas}
        reports = {n: {t: Want(min(demand[n, t], quotas[t]), held[n, t]) for t in quotas} for n in nodes}
        r, _, _ = ledger.round(nodes, reports)
        total = 0.0
        for t, tr in r.tenants.items():
            assert tr.committed <= quotas[t] + 1e-6
            total += sum(max(held[n, t], tr.grants[n]) for n in nodes)
        assert total <= capacity + 1e-6
        for n in nodes:
            for t in quotas:
                if rng.random() < 0.7:
                    held[n, t] = r.tenants[t].grants[n]
    assert sum(r.tenants["gold"].grants.values()) >= 300 - 1e-6
    assert sum(r.tenants["silver"].grants.values()) >= 300 - 1e-6 - len(nodes) * minimum(400, len(nodes))
