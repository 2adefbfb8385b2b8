"""The latency program's map layouts (bpf/latency.c, bpf/include/qos_*.h) and what the agent writes into them.

Pure where it can be: the entries the tenant maps should hold are computed from config here and tested without BPF.
"""

from __future__ import annotations

import ctypes as ct
import ipaddress
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

from qosagent.config import Config
from qosagent.tenants import tenant_id

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

CIDR_PORT_BITS = 16  # a qos_cidr_key's prefix counts the port first


class HistKey(ct.Structure):
    _fields_ = [("tenant", ct.c_uint32), ("kind", ct.c_uint16), ("bucket", ct.c_uint16)]


class CounterKey(ct.Structure):
    _fields_ = [("tenant", ct.c_uint32), ("what", ct.c_uint32)]


HIST_VALUE = struct.Struct("<QQ")  # count, sum_ns
COUNTER_VALUE = struct.Struct("<Q")


@dataclass(frozen=True)
class CidrEntry:
    """One tenant_cidrs entry: (prefixlen counted from the port, port in host order or 0, 16-byte address)."""

    prefixlen: int
    port: int
    addr: bytes
    tenant: int


def mapped16(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> tuple[bytes, int]:
    """A network as a 16-byte address and prefix length; IPv4 as ::ffff:a.b.c.d, the way the kernel reports peers."""
    if isinstance(net, ipaddress.IPv4Network):
        return b"\0" * 10 + b"\xff\xff" + net.network_address.packed, 96 + net.prefixlen
    return net.network_address.packed, net.prefixlen


def tenant_entries(cfg: Config) -> tuple[dict[int, int], list[CidrEntry]]:
    """What tenant_ports and tenant_cidrs hold for a config.

    A tenant matching ports alone claims those ports (tenant_ports). One matching CIDRs claims those client
    addresses on each of its ports, or on every watched port (port 0) when it names none. Header-matched tenants
    are the quota classifier's business: their connections resolve by port or address here like any other."""
    ports: dict[int, int] = {}
    cidrs: list[CidrEntry] = []
    for t in cfg.tenants:
        tid = tenant_id(t.name)
        m = t.match
        if m.ports and not m.cidrs and not m.header:
            for p in m.ports:
                ports[p] = tid
            continue
        for c in m.cidrs:
            addr, plen = mapped16(ipaddress.ip_network(c, strict=False))
            for p in m.ports or [0]:
                cidrs.append(CidrEntry(CIDR_PORT_BITS + plen, p, addr, tid))
    return ports, cidrs


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

