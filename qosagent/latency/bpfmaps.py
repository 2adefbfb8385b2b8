"""The latency program's map layouts (bpf/latency.c, bpf/include/qos_*.h) and what the agent writes into them.

Pure where it can be: the entries the tenant maps should hold are computed from config here and tested without BPF.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

from qosagent.config import Config

# Histogram kinds and counters, as numbered in bpf/latency.c.
KIND_TTFB = 0
KIND_RESPONSE = 1
KIND_RUNQ = 2

# Completed and answered requests are the response and TTFB histogram counts (no counters in the kernel).
C_STARTED = 1
C_UNPAIRED_SEND = 3
C_UNPAIRED_CLOSE = 4
C_EXTRA_READS = 5
C_CONNS = 6
C_MUX_CONNS = 7
C_OVERLAPPED = 8
C_LOST = 9
C_UNTRACKED = 10


HIST_KEY = struct.Struct("<IHH")  # struct lat_hist_key: tenant, kind, bucket
COUNTER_KEY = struct.Struct("<II")  # struct lat_counter_key: tenant, what
HIST_VALUE = struct.Struct("<QQ")  # count, sum_ns
COUNTER_VALUE = struct.Struct("<Q")


def watched(cfg: Config) -> list[int]:
    return sorted(set(cfg.watched_ports()) | set(cfg.latency.multiplexed_ports))


def per_cpu_value_size(leaf_size: int, ncpus: int) -> int:
    """The kernel hands per-CPU values out as one 8-byte-aligned slot per possible CPU."""
    return ((leaf_size + 7) // 8 * 8) * ncpus


def per_cpu_sums(values: bytes, n: int, fields: int) -> list[list[int]]:
    """Per field, the sum over CPUs of each of n per-CPU values of `fields` u64s each, as the kernel hands them out
    (entry after entry, CPU after CPU). Whole columns at a time: slicing and map() stay in C, where a loop over
    entries and CPUs in Python cost most of a tick under load."""
    if n == 0:
        return [[] for _ in range(fields)]
    q = memoryview(values).cast("Q")
    stride = len(q) // n
    ncpus = stride // fields
    out = []
    for f in range(fields):
        acc = list(q[f::stride])
        for cpu in range(1, ncpus):
            acc = list(map(operator.add, acc, q[cpu * fields + f::stride]))
        out.append(acc)
    return out


@dataclass(frozen=True)
class Raw:
    """One read of the kernel's cumulative state: histograms (tenant, kind) -> {bucket: count}, sums, counters."""

    hist: Mapping[tuple[int, int], Mapping[int, int]]
    sums: Mapping[tuple[int, int], int]
    counters: Mapping[tuple[int, int], int]


Chunk = tuple[bytes, bytes, int]  # keys, values, n: one BatchReader.chunks() step


def assemble(hist_chunks: Iterable[Chunk], counter_chunks: Iterable[Chunk]) -> Raw:
    hist: dict[tuple[int, int], dict[int, int]] = {}
    sums: dict[tuple[int, int], int] = {}
    for keys, values, n in hist_chunks:
        counts, totals = per_cpu_sums(values, n, 2)
        for (tenant, kind, bucket), count, total in zip(HIST_KEY.iter_unpack(keys), counts, totals):
            key = (tenant, kind)
            hist.setdefault(key, {})[bucket] = count
            sums[key] = sums.get(key, 0) + total
    counters: dict[tuple[int, int], int] = {}
    for keys, values, n in counter_chunks:
        (totals,) = per_cpu_sums(values, n, 1)
        counters.update(zip(COUNTER_KEY.iter_unpack(keys), totals))
    return Raw(hist, sums, counters)
