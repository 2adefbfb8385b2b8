"""The latency program's map layouts (bpf/latency.c, bpf/include/qos_*.h) and what the agent writes into them.

Pure where it can be: the entries the tenant maps should hold are computed from config here and tested without BPF.
"""

from __future__ import annotations

import ctypes as ct
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


class HistKey(ct.Structure):
    _fields_ = [("tenant", ct.c_uint32), ("kind", ct.c_uint16), ("bucket", ct.c_uint16)]


class CounterKey(ct.Structure):
    _fields_ = [("tenant", ct.c_uint32), ("what", ct.c_uint32)]


HIST_VALUE = struct.Struct("<QQ")  # count, sum_ns
COUNTER_VALUE = struct.Struct("<Q")


def watched(cfg: Config) -> list[int]:
    return sorted(set(cfg.watched_ports()) | set(cfg.latency.multiplexed_ports))


def per_cpu_value_size(leaf_size: int, ncpus: int) -> int:
    """The kernel hands per-CPU values out as one 8-byte-aligned slot per possible CPU."""
    return ((leaf_size + 7) // 8 * 8) * ncpus


def sum_hist_value(raw: bytes) -> tuple[int, int]:
    count = total = 0
    for c, s in HIST_VALUE.iter_unpack(raw):
        count += c
        total += s
    return count, total


def sum_counter_value(raw: bytes) -> int:
    return sum(v for (v,) in COUNTER_VALUE.iter_unpack(raw))


@dataclass(frozen=True)
class Raw:
    """One read of the kernel's cumulative state: histograms (tenant, kind) -> {bucket: count}, sums, counters."""

    hist: Mapping[tuple[int, int], Mapping[int, int]]
    sums: Mapping[tuple[int, int], int]
    counters: Mapping[tuple[int, int], int]


def assemble(hist_rows: Iterable[tuple[HistKey, bytes]], counter_rows: Iterable[tuple[CounterKey, bytes]]) -> Raw:
    hist: dict[tuple[int, int], dict[int, int]] = {}
    sums: dict[tuple[int, int], int] = {}
    for k, raw in hist_rows:
        count, total = sum_hist_value(raw)
        key = (k.tenant, k.kind)
        hist.setdefault(key, {})[k.bucket] = count
        sums[key] = sums.get(key, 0) + total
    counters = {(k.tenant, k.what): sum_counter_value(raw) for k, raw in counter_rows}
    return Raw(hist, sums, counters)

