"""The parts' per-tenant rows (qosagent/rowmap.py): a RowMap reads as the dict it stands for, in the same order, and
its next version copies the rows changed since its base, not every row."""

from __future__ import annotations

import random

import pytest

from qosagent.rowmap import FOLD_MIN, RowMap


def test_a_version_reads_as_the_dict_it_stands_for() -> None:
    rnd = random.Random(26)
    want = {f"t{i}": i for i in range(200)}
    m: RowMap[str, int] = RowMap(want)
    versions = [(m, dict(want))]
    for _ in range(300):
        changes = {f"t{rnd.randrange(200)}": rnd.randrange(1000) for _ in range(rnd.choice((0, 1, 3, 40)))}
        if rnd.random() < 0.05:
            changes[f"new{rnd.randrange(10**6)}"] = -1  # a key it lacks: added at the end, as a dict would
        want = {**want, **changes}
        m = m.replace(changes)
        versions.append((m, dict(want)))
    for m, want in versions:  # every version still says what it said when made
        assert list(m) == list(want) and list(m.items()) == list(want.items())
        assert list(m.values()) == list(want.values()) and len(m) == len(want) and m == want
        assert all(m[k] == v and k in m and m.get(k, "default") == v for k, v in want.items())
        assert m.get("absent") is None and m.get("absent", 7) == 7 and "absent" not in m


def test_get_is_a_dicts_not_a_raised_keyerror(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission asks latency's rows for tenants it has none for (TenantInputs): RowMap's own get answers from its
    dicts; Mapping's would go through __getitem__ and a KeyError for each of them."""
    m: RowMap[str, int] = RowMap({"t1": 1, "t2": 2}).replace({"t2": 20})

    def no_getitem(self: object, key: object) -> int:
        raise AssertionError("get went through __getitem__")

    monkeypatch.setattr(RowMap, "__getitem__", no_getitem)
    assert m.get("t1") == 1 and m.get("t2") == 20 and m.get("t3") is None and m.get("t3", -1) == -1


def test_the_next_version_copies_only_the_rows_changed_since_its_base() -> None:
    rows = {f"t{i}": object() for i in range(1000)}
    m: RowMap[str, object] = RowMap(rows)
    assert m.replace({}) is m
    before = RowMap.copied
    ten = {f"t{i}": object() for i in range(0, 1000, 100)}
    for _ in range(50):  # the same ten tenants changing every tick: ten rows a version, never the thousand
        m = m.replace(ten)
    assert RowMap.copied - before == 50 * 10
    assert all(m[k] is v for k, v in ten.items()) and all(m[k] is rows[k] for k in rows if k not in ten)
    # Once more than an eighth of the rows changed since the base, they are folded into a new one: one copy.
    before = RowMap.copied
    m = m.replace({f"t{i}": 0 for i in range(1000 // 8 + 1)})
    assert RowMap.copied - before == 1000
    before = RowMap.copied
    m = m.replace({"t999": 1})
    assert RowMap.copied - before == 1 and m["t999"] == 1 and m["t0"] == 0
    small: RowMap[str, int] = RowMap({f"t{i}": i for i in range(10)})
    for i in range(30):  # a small map never folds below FOLD_MIN rows changed
        before = RowMap.copied
        small = small.replace({f"t{i % 10}": -i})
        assert RowMap.copied - before <= FOLD_MIN


def test_with_different_tenants_each_tick_a_version_copies_at_most_an_eighth_and_then_folds() -> None:
    """Counted: a tick moving one tenant copies that row alone only while the same tenants keep changing. With the
    active tenants rotating, the rows changed since the base add up: each version copies all of them, never more than
    max(FOLD_MIN, n/8), and the version past that folds them into a new base (one copy of the n rows); on average
    ~n/16 + 8k rows a tick for k tenants a tick, as RowMap's docstring says. Every version reads as its dict."""
    rnd = random.Random(8)
    for n, k, ticks in ((1000, 10, 300), (100, 3, 200)):
        bound = max(FOLD_MIN, n // 8)
        want = {f"t{i}": -1 for i in range(n)}
        m: RowMap[str, int] = RowMap(want)
        versions = [(m, want)]
        since_base: set[str] = set()  # the tenants changed since the last fold, as the test sees them
        folds, total = 0, 0
        for t in range(ticks):
            active = [f"t{(t * k + j) % n}" for j in range(k)]  # k tenants, none of them last tick's
            if rnd.random() < 0.3:
                active.append(rnd.choice(sorted(since_base or {"t0"})))  # and now and then one changed before
            changes = {name: t for name in active}
            before = RowMap.copied
            m = m.replace(changes)
            copied = RowMap.copied - before
            total += copied
            since_base |= changes.keys()
            if len(since_base) > bound:  # past the bound: one copy of every row, and a base with nothing changed
                assert copied == n
                folds, since_base = folds + 1, set()
            else:  # the rows changed since the base, not a row more, never above the bound
                assert copied == len(since_base) <= bound
            want = {**want, **changes}
            versions.append((m, want))
        assert folds >= ticks * k // (bound + k + 1)  # a fold about every n/8 distinct rows changed
        assert total / ticks <= n / 16 + 8 * (k + 1)  # the average the docstring gives, against n for a dict's copy
        for m, want in versions:  # every version, folded or not, still reads as the dict it stood for when made
            assert list(m.items()) == list(want.items()) and list(m.values()) == list(want.values())
            assert len(m) == n and all(m[key] == v for key, v in want.items())
