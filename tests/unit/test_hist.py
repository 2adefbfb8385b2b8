from __future__ import annotations

import random

import pytest

from qosagent.hist import (
    NBUCKETS,
    SUB,
    Histogram,
    Since,
    bucket_index,
    bucket_lower,
    bucket_upper,
    export_bounds_ns,
)


def test_small_values_are_exact() -> None:
    assert [bucket_index(v) for v in range(0, SUB + 1)] == [0, 0] + list(range(1, SUB))
    assert bucket_upper(bucket_index(7)) == 7


@pytest.mark.parametrize("v", [17, 31, 32, 33, 1000, 1023, 1024, 1025, 120_000_000, 2**35, 2**35 + 1])
def test_value_lies_in_its_bucket(v: int) -> None:
    i = bucket_index(v)
    assert bucket_lower(i) < v <= bucket_upper(i)


def test_edges_are_inclusive_upper() -> None:
    # 1024 is the upper edge of one bucket and 1025 starts the next: (lower, upper].
    i = bucket_index(1024)
    assert bucket_upper(i) == 1024
    assert bucket_index(1025) == i + 1
    assert bucket_lower(i + 1) == 1024


def test_buckets_tile_the_line_without_gaps() -> None:
    for i in range(NBUCKETS - 1):
        assert bucket_upper(i) == bucket_lower(i + 1), i
        assert bucket_index(bucket_upper(i)) == i
        assert bucket_index(bucket_upper(i) + 1) == i + 1


def test_bucket_width_bounds_relative_error() -> None:
    for i in range(SUB, NBUCKETS):
        lo, hi = bucket_lower(i), bucket_upper(i)
        assert (hi - lo) / lo <= 1 / SUB + 1e-12


def test_huge_values_clamp_to_last_bucket() -> None:
    assert bucket_index(2**50) == NBUCKETS - 1


@pytest.mark.parametrize("q", [0.5, 0.9, 0.95, 0.99])
def test_quantiles_within_ten_percent_of_truth(q: float) -> None:
    rng = random.Random(7)
    values = [int(rng.lognormvariate(17.5, 0.8)) for _ in range(20000)]  # ~40 ms median, long tail
    h = Histogram.of(values)
    truth = sorted(values)[int(q * len(values)) - 1] / 1e9
    est = h.quantile(q)
    assert est is not None and abs(est - truth) / truth < 0.10


def test_quantile_of_constant_is_inside_its_bucket() -> None:
    h = Histogram.of([20_000_000] * 50)
    assert 20_000_000 * (1 - 1 / SUB) / 1e9 <= h.quantile(0.99) <= 20_000_000 * (1 + 1 / SUB) / 1e9
    assert Histogram().quantile(0.5) is None


def test_window_is_a_difference() -> None:
    old = Histogram.of([10, 20, 30])
    new = old + Histogram.of([5_000_000])
    w = new - old
    assert w.count == 1 and w.sum_ns == 5_000_000


def test_cumulative_at_export_bounds_is_exact() -> None:
    bounds = export_bounds_ns()
    assert bounds == sorted(bounds) and all(bucket_index(b) + 1 == bucket_index(b + 1) for b in bounds)
    values = [bounds[3], bounds[3] + 1, bounds[10]]
    cum = Histogram.of(values).cumulative(bounds)
    assert cum[3] == 1 and cum[4] == 2 and cum[10] == 3 and cum[2] == 0


def test_since_is_the_difference_worked_out_only_when_read() -> None:
    older = Histogram.of([1_000, 2_000, 3_000])
    newer = older + Histogram.of([2_000, 50_000])
    s = Since(newer, older)
    assert s.count == 2 and "_diff" not in s.__dict__  # a rate needs no bucket walk
    assert s == newer - older == Histogram.of([2_000, 50_000])
    assert s.sum_ns == 52_000 and s.quantile(1.0) == (newer - older).quantile(1.0)
    # Counters that went backwards (a reset) read as everything new, as the subtraction has it.
    assert Since(older, newer).count == older.count and Since(older, newer) == older
    assert Since(newer, Histogram()) == newer


def test_fine_export_bounds_are_exact_edges_finer_in_their_range() -> None:
    bounds = export_bounds_ns(17, 37, 2, (23, 32, 8))
    assert bounds == sorted(set(bounds))
    assert all(bucket_index(b) + 1 == bucket_index(b + 1) for b in bounds)
    assert len(bounds) == 2 * (37 - 17 - 9) + 8 * 9 + 1
    in_fine = [b for b in bounds if 1 << 23 <= b < 1 << 32]
    assert len(in_fine) == 72 and all(b % (1 << (b.bit_length() - 4)) == 0 for b in in_fine)
    with pytest.raises(ValueError):
        export_bounds_ns(17, 37, 3)
