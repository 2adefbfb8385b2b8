"""Log-linear latency histograms: the bucket layout the BPF programs fill, and quantiles estimated from it.

Layout (mirrored in bpf/include/qos_hist.h): values are nanoseconds; 16 linear sub-buckets per power of two, so a
bucket is at most 1/16 of its lower bound wide and a quantile interpolated inside it is off by at most ~6 %.
The index is computed from v-1, which makes each bucket (lower, upper] — Prometheus' `le` is inclusive, and so the
exported cumulative counts are exact at the bucket edges (ebpf_exporter#488 is the off-by-one this avoids).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Mapping

SUB_BITS = 4
SUB = 1 << SUB_BITS  # sub-buckets per power of two
MAX_LOG2 = 40  # 2^40 ns ≈ 18 min: anything longer lands in the last bucket
NBUCKETS = (MAX_LOG2 - SUB_BITS + 1) * SUB + SUB  # 608


def bucket_index(v_ns: int) -> int:
    """The bucket of a value in ns. Same arithmetic as qos_hist_index() in BPF."""
    x = v_ns - 1 if v_ns > 0 else 0
    if x < SUB:
        return x
    msb = x.bit_length() - 1
    if msb > MAX_LOG2:
        return NBUCKETS - 1
    shift = msb - SUB_BITS
    return (shift + 1) * SUB + ((x >> shift) - SUB)


def bucket_lower(i: int) -> int:
    """Exclusive lower edge in ns: the bucket holds lower < v <= upper."""
    if i < SUB:
        return i
    shift = i // SUB - 1
    return (SUB + i % SUB) << shift


def bucket_upper(i: int) -> int:
    """Inclusive upper edge in ns."""
    if i < SUB:
        return i + 1
    shift = i // SUB - 1
    return ((SUB + i % SUB) << shift) + (1 << shift)


def export_bounds_ns(lo_log2: int = 17, hi_log2: int = 37, per_octave: int = 2,
                     fine: tuple[int, int, int] | None = None) -> list[int]:
    """Bucket edges exported as Prometheus `le` bounds: a few per power of two, each an exact bucket edge.

    `fine` = (from_log2, to_log2, per_octave): the powers of two from 2^from_log2 up to 2^to_log2 ns get that many
    edges each instead (where the SLOs live). Edges per power of two must divide SUB (1, 2, 4, 8 or 16)."""
    bounds = []
    for e in range(lo_log2, hi_log2):
        n = fine[2] if fine is not None and fine[0] <= e < fine[1] else per_octave
        if n < 1 or SUB % n:
            raise ValueError(f"edges per power of two must divide {SUB}, got {n}")
        for k in range(0, SUB, SUB // n):
            bounds.append((SUB + k) << (e - SUB_BITS))
    bounds.append(1 << hi_log2)
    return bounds


@dataclass(frozen=True, eq=False)
class Histogram:
    """Counts per bucket index (sparse) and the exact sum of the values in ns."""

    counts: Mapping[int, int] = field(default_factory=dict)
    sum_ns: int = 0

    def __eq__(self, other: object) -> bool:  # by value, whichever kind (Since) either side is
        if not isinstance(other, Histogram):
            return NotImplemented
        return self.sum_ns == other.sum_ns and dict(self.counts) == dict(other.counts)

    @staticmethod
    def of(values_ns: Iterable[int]) -> "Histogram":
        counts: dict[int, int] = {}
        total = 0
        for v in values_ns:
            i = bucket_index(v)
            counts[i] = counts.get(i, 0) + 1
            total += v
        return Histogram(counts, total)

    @functools.cached_property
    def count(self) -> int:
        return sum(self.counts.values())

    def __add__(self, other: "Histogram") -> "Histogram":
        out = dict(self.counts)
        for i, c in other.counts.items():
            out[i] = out.get(i, 0) + c
        return Histogram(out, self.sum_ns + other.sum_ns)

    def __sub__(self, older: "Histogram") -> "Histogram":
        """What was added since `older` (counters only grow; a reset reads as everything new)."""
        if self.counts is older.counts:  # an idle tenant's row, unchanged and not parsed again since `older`
            return Histogram({}, max(self.sum_ns - older.sum_ns, 0))
        before = older.counts.get
        diff = {i: c - before(i, 0) for i, c in self.counts.items()}  # comprehensions: the tick's hottest loop
        if diff and min(diff.values()) < 0:
            return self
        return Histogram({i: d for i, d in diff.items() if d}, max(self.sum_ns - older.sum_ns, 0))

    def quantile(self, q: float) -> float | None:
        """The q-quantile in seconds, interpolated linearly inside its bucket; None when empty."""
        n = self.count
        if n == 0:
            return None
        rank = q * n
        seen = 0
        for i in sorted(self.counts):
            c = self.counts[i]
            if seen + c >= rank:
                lo, hi = bucket_lower(i), bucket_upper(i)
                frac = (rank - seen) / c if c else 1.0
                return (lo + (hi - lo) * min(max(frac, 0.0), 1.0)) / 1e9
            seen += c
        return bucket_upper(max(self.counts)) / 1e9

    def cumulative(self, bounds_ns: list[int]) -> list[int]:
        """Counts of values <= each bound (bounds must be bucket edges, as export_bounds_ns gives)."""
        out = []
        items = sorted(self.counts.items())
        j = 0
        acc = 0
        for b in bounds_ns:
            while j < len(items) and bucket_upper(items[j][0]) <= b:
                acc += items[j][1]
                j += 1
            out.append(acc)
        return out


class Since(Histogram):
    """What `newer` gained since `older` (newer - older), worked out when first read. The latency tick makes a window
    per tenant and kind every tick, and most ticks nothing reads them (metrics and status read on request, admission
    one kind); the subtraction walks every bucket the tenant has ever used. `count` is cheap either way."""

    def __init__(self, newer: Histogram, older: Histogram):  # no super().__init__: the fields are worked out
        object.__setattr__(self, "_pair", (newer, older))

    @functools.cached_property
    def _diff(self) -> Histogram:
        newer, older = self._pair
        return newer - older

    @property  # type: ignore[override]
    def counts(self) -> Mapping[int, int]:
        return self._diff.counts

    @property  # type: ignore[override]
    def sum_ns(self) -> int:
        return self._diff.sum_ns

    @property
    def count(self) -> int:
        newer, older = self._pair
        d = newer.count - older.count
        # A row that went backwards (counters reset) reads as everything new, as __sub__ has it.
        return d if d >= 0 else self._diff.count
