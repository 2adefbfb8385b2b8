"""Native histograms from the internal layout: exact edges, conserved counts, and counts that never go down."""

from __future__ import annotations

import math
import random
from decimal import Decimal, getcontext

import pytest

from qosagent.hist import NBUCKETS, SUB, Histogram, bucket_index, bucket_lower, bucket_upper
from qosagent.nativehist import (
    SCHEMA,
    Native,
    apportion,
    native,
    native_counts,
    native_index,
    native_upper_ns,
    overlaps,
    spans_and_deltas,
)


@pytest.mark.parametrize("schema", [0, 3, 4])
def test_native_edges_are_exact_floors(schema: int) -> None:
    getcontext().prec = 60
    n = 1 << schema
    for k in range(-30 * n, 12 * n, 7 if schema else 1):
        exact = Decimal(10**9) * (Decimal(2) ** (Decimal(k) / n))
        assert native_upper_ns(k, schema) == math.floor(exact), k
    # Whole powers of two of a second are integers of ns down to 2^-9 s: the edge is the value itself.
    assert native_upper_ns(-9 * n, schema) == 1953125
    assert native_upper_ns(0, schema) == 10**9


def test_native_index_puts_values_inside_their_bucket_upper_inclusive() -> None:
    rng = random.Random(3)
    for v in [2, 3, 1000, 10**9, 10**9 + 1, 1953125, 1953126] + [rng.randrange(2, 1 << 40) for _ in range(2000)]:
        k = native_index(v)
        assert native_upper_ns(k - 1) < v <= native_upper_ns(k), v
    assert native_index(10**9) == 0 and native_index(10**9 + 1) == 1


def test_overlaps_cover_each_internal_bucket_exactly() -> None:
    for schema in (3, 4):
        for i in range(1, NBUCKETS):
            ov = overlaps(i, schema)
            assert sum(w for _, w in ov) == bucket_upper(i) - bucket_lower(i), i
            ks = [k for k, _ in ov]
            assert ks == list(range(ks[0], ks[-1] + 1))
            # An internal bucket is at most 1/16 of its lower edge wide: it touches at most 2 (schema 3) or 3 native
            # buckets (schema 4, 2^(1/16)-1 = 4.4 % wide).
            assert len(ov) <= (2 if schema == 3 else 3)


def test_apportion_shares_add_up_and_follow_the_weights() -> None:
    assert apportion(10, ((1, 1), (2, 1))) == [(1, 5), (2, 5)]
    assert apportion(7, ((5, 3),)) == [(5, 7)]
    assert apportion(0, ((1, 3), (2, 7))) == [(1, 0), (2, 0)]
    rng = random.Random(11)
    for _ in range(500):
        weights = tuple((k, rng.randrange(0, 1 << 20)) for k in range(rng.randrange(1, 4)))
        if sum(w for _, w in weights) == 0:
            continue
        c = rng.randrange(0, 10**12)
        shares = apportion(c, weights)
        assert sum(s for _, s in shares) == c
        total = sum(w for _, w in weights)
        # Within 1 of the exact share for the first, within 2 for later ones (each is rounded out of a rounded rest).
        for (_, w), (_, s) in zip(weights, shares):
            assert abs(s - c * w / total) <= 2


def test_apportion_never_takes_from_a_share_as_the_count_grows() -> None:
    """The naive rule fails here (floor(0.7c) - floor(0.3c) is 2 at c=3, 1 at c=4); this one may not, for any
    weights: every count from 0 to 3000 for a few hundred weight vectors, two and three ways."""
    rng = random.Random(5)
    cases = [(((0, 3), (1, 4), (2, 3)), 3000), (((0, 1), (1, 1)), 3000), (((0, 1), (1, 10**6)), 3000),
             (((0, 10**6), (1, 1), (2, 1)), 3000)]
    cases += [(tuple((k, rng.randrange(1, 5000)) for k in range(rng.choice((2, 3)))), 400) for _ in range(300)]
    for weights, upto in cases:
        prev = [0] * len(weights)
        for c in range(upto):
            now = [s for _, s in apportion(c, weights)]
            assert all(a >= b for a, b in zip(now, prev)), (weights, c, prev, now)
            assert sum(now) == c
            prev = now


def test_native_buckets_never_go_down_as_the_histogram_grows() -> None:
    """Cumulative internal counts only grow; so must every native bucket, scrape after scrape."""
    rng = random.Random(8)
    counts: dict[int, int] = {}
    prev: dict[int, int] = {}
    prev_zero = 0
    for _ in range(300):
        for _ in range(rng.randrange(1, 50)):
            i = bucket_of(rng.lognormvariate(math.log(45e6), 0.4))
            counts[i] = counts.get(i, 0) + rng.choice((1, 1, 1, 2, 7, 1000))
        zero, now = native_counts(Histogram(dict(counts)))
        assert zero >= prev_zero
        assert all(now.get(k, 0) >= c for k, c in prev.items()), "a native bucket went down"
        assert zero + sum(now.values()) == sum(counts.values())
        prev, prev_zero = now, zero


def bucket_of(v: float) -> int:
    return bucket_index(int(v))


def test_spans_and_deltas_round_trip_with_gaps() -> None:
    counts = {-3: 4, -2: 1, 0: 9, 1: 9, 7: 2, 20: 5}
    spans, deltas = spans_and_deltas(counts)
    # -3..1 is one span (the gap of one at -1 is filled with a zero); 7 and 20 are further away.
    assert spans == ((-3, 5), (5, 1), (12, 1))
    assert deltas == (4, -3, -1, 9, 0, -7, 3)
    decoded = Native(SCHEMA, 1e-9, 0, spans, deltas, 0, 0.0).buckets()
    assert {k: c for k, c in decoded.items() if c} == counts
    assert spans_and_deltas({}) == (((0, 0),), ())  # a no-op span: native before the first observation


def test_native_of_a_histogram_keeps_count_sum_and_zero_bucket() -> None:
    values = [0, 1, 1, 2, 5, 999, 45_000_000, 45_000_001, 10**9, 10**9 + 1, 3 * 10**12]
    h = Histogram.of(values)
    n = native(h)
    assert n.count == len(values) and n.sum == pytest.approx(sum(values) / 1e9)
    assert n.zero_threshold == 1e-9 and n.zero_count == 3  # 0, 1 and 1 ns: internal bucket 0
    b = n.buckets()
    assert n.zero_count + sum(b.values()) == len(values)
    # 1 s and 1 s + 1 ns share an internal bucket (~31 ms wide) that straddles the native edge at 1 s: its two
    # observations are shared by overlap, not placed by value (the internal histogram no longer knows them).
    assert b.get(0, 0) + b.get(1, 0) == 2
    assert b[native_index(2)] == 1 and b[native_index(5)] == 1 and b[native_index(999)] == 1


def test_values_on_a_native_edge_are_not_split() -> None:
    """An internal bucket whose values all lie in one native bucket gives it everything: 16 one-ns buckets."""
    for i in range(1, SUB):
        assert len(overlaps(i)) == 1


def test_midpoint_split_also_conserves_counts() -> None:
    rng = random.Random(2)
    h = Histogram.of(int(rng.lognormvariate(math.log(45e6), 0.2)) for _ in range(5000))
    for split in ("overlap", "midpoint"):
        zero, c = native_counts(h, 3, split)
        assert zero + sum(c.values()) == h.count
