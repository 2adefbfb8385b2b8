"""Prometheus native (exponential) histograms worked out from the log-linear internal layout (qosagent/hist.py).

A native histogram of schema s has 2^s buckets per power of two of the value in seconds: bucket k holds
2^((k-1)/2^s) < v <= 2^(k/2^s), and a zero bucket holds |v| <= zero_threshold. Our values are integer
nanoseconds, so bucket k is exactly the integers (U(k-1), U(k)] with U(k) = floor(1e9 * 2^(k/2^s)), worked out in
integer arithmetic (native_upper_ns) so that no float rounding can move an edge.

The internal buckets (16 per power of two of the value in ns) do not line up with those edges, so each internal
bucket's count is shared among the native buckets it overlaps, in proportion to the overlap (the values are taken
as spread evenly inside an internal bucket): docs/latency.md, "Export precision", has the measurement that chose
this over giving each internal bucket wholly to the native bucket of its midpoint, and schema 3.

Native bucket counts are cumulative since start, so between two scrapes none may go down (Prometheus would read a
counter reset). Counts are integers, and naive rounding of shares breaks that (floor(c*0.7) - floor(c*0.3) is 2 at
c=3 and 1 at c=4). apportion() takes each share in turn, rounded, out of what is left: every share then grows by 0 or
1 when the internal count grows by 1, so native counts never go down and always add up to the exact count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

from qosagent.hist import NBUCKETS, Histogram, bucket_lower, bucket_upper

SCHEMA = 3
# Internal bucket 0 holds 0 and 1 ns: exactly the zero bucket with a 1 ns threshold. A threshold above 0 also
# marks the histogram as native for every Prometheus since 2.40, even before the first observation.
ZERO_THRESHOLD_NS = 1
_NS = 10**9


@functools.lru_cache(maxsize=None)
def native_upper_ns(k: int, schema: int = SCHEMA) -> int:
    """The largest integer ns in native bucket k: floor(1e9 * 2^(k / 2^schema)), exactly."""
    n = 1 << schema
    # b is the largest integer with b^n <= 1e9^n * 2^k; k < 0 moves 2^-k to the left side.
    left, right = (1 << -k, _NS**n) if k < 0 else (1, _NS**n << k)
    b = int(_NS * 2.0 ** (k / n))  # within a few ns of the answer; the loops make it exact
    while b > 0 and b**n * left > right:
        b -= 1
    while (b + 1) ** n * left <= right:
        b += 1
    return b


def native_index(v_ns: int, schema: int = SCHEMA) -> int:
    """The native bucket of a value in ns (> ZERO_THRESHOLD_NS)."""
    n = 1 << schema
    k = (v_ns.bit_length() - 30) * n  # 2^29 < 1e9 < 2^30: at or below the answer
    while native_upper_ns(k, schema) >= v_ns:
        k -= n
    while native_upper_ns(k, schema) < v_ns:
        k += 1
    return k


@functools.lru_cache(maxsize=None)
def overlaps(i: int, schema: int = SCHEMA) -> tuple[tuple[int, int], ...]:
    """(native bucket, how many integer ns of internal bucket i it holds) for each native bucket i overlaps."""
    lo, hi = bucket_lower(i), bucket_upper(i)
    out = []
    for k in range(native_index(lo + 1, schema), native_index(hi, schema) + 1):
        w = min(hi, native_upper_ns(k, schema)) - max(lo, native_upper_ns(k - 1, schema))
        if w > 0:
            out.append((k, w))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def midpoint_bucket(i: int, schema: int = SCHEMA) -> int:
    """The native bucket holding internal bucket i's midpoint (the alternative measured against overlaps)."""
    return native_index((bucket_lower(i) + bucket_upper(i) + 1) // 2, schema)


def apportion(count: int, weights: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Split an integer count among keys in proportion to integer weights: [(key, share)], shares summing to count.

    Each share is rounded (half up) out of what the shares before it left, so when count grows by 1 every share
    grows by 0 or 1: round((c+1)*w/W) - round(c*w/W) is 0 or 1 for w <= W, and what is left then grows by 0 or 1 as
    well. Shares never go down as count grows (tests/unit/test_nativehist.py checks it exhaustively)."""
    left, total = count, sum(w for _, w in weights)
    out = []
    for key, w in weights[:-1]:
        share = (2 * left * w + total) // (2 * total)
        out.append((key, share))
        left -= share
        total -= w
    out.append((weights[-1][0], left))
    return out


@dataclass(frozen=True)
class Native:
    """One native histogram: the fields Prometheus' protobuf exposition carries for it (positive side only)."""

    schema: int
    zero_threshold: float  # seconds
    zero_count: int
    spans: tuple[tuple[int, int], ...]  # (offset, length): offset from the previous span's end, the first absolute
    deltas: tuple[int, ...]  # each bucket's count minus the previous bucket's (the first: minus 0)
    count: int
    sum: float  # seconds

    def buckets(self) -> dict[int, int]:
        """Native bucket index -> count (zero-count buckets inside spans included)."""
        out: dict[int, int] = {}
        k, j, c = 0, 0, 0
        for offset, length in self.spans:
            k += offset
            for _ in range(length):
                c += self.deltas[j]
                out[k] = c
                j += 1
                k += 1
        return out


def native_counts(h: Histogram, schema: int = SCHEMA, split: str = "overlap") -> tuple[int, dict[int, int]]:
    """(zero bucket count, native bucket -> count) of an internal histogram. split="midpoint" is for measuring."""
    zero = 0
    out: dict[int, int] = {}
    for i, c in h.counts.items():
        if c <= 0:
            continue
        if i == 0:
            zero += c
            continue
        i = min(i, NBUCKETS - 1)
        if split == "midpoint":
            shares = [(midpoint_bucket(i, schema), c)]
        else:
            shares = apportion(c, overlaps(i, schema))
        for k, s in shares:
            if s:
                out[k] = out.get(k, 0) + s
    return zero, out


def spans_and_deltas(counts: Mapping[int, int], fill: int = 2) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Spans and deltas of sparse bucket counts; gaps of up to `fill` empty buckets go inside a span as zeros
    (cheaper than a new span, as Prometheus' clients do)."""
    spans: list[list[int]] = []
    deltas: list[int] = []
    prev_k: int | None = None
    prev_c = 0
    for k in sorted(counts):
        gap = None if prev_k is None else k - prev_k - 1
        if gap is None or gap > fill:
            spans.append([k if prev_k is None else gap, 0])
        else:
            for _ in range(gap):
                deltas.append(-prev_c)
                prev_c = 0
            spans[-1][1] += gap
        deltas.append(counts[k] - prev_c)
        prev_c = counts[k]
        spans[-1][1] += 1
        prev_k = k
    if not spans:
        spans.append([0, 0])  # a no-op span: native even with no observations yet
    return tuple((o, n) for o, n in spans), tuple(deltas)


def native(h: Histogram, schema: int = SCHEMA) -> Native:
    """The native histogram of an internal one (cumulative since start: as monotonic as the internal counts)."""
    zero, counts = native_counts(h, schema)
    spans, deltas = spans_and_deltas(counts)
    return Native(schema, ZERO_THRESHOLD_NS / 1e9, zero, spans, deltas, h.count, h.sum_ns / 1e9)
