"""ArrayRange reads slices of real BPF arrays in one BPF_MAP_LOOKUP_BATCH: what the latency tick reads its
histogram rows and per-CPU counters with."""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Iterator

import pytest

from qosagent.ebpf.maps import ArrayRange

PROG = b"""
struct row { __u64 a; __u64 b; };
BPF_ARRAY(shared, struct row, 8);
BPF_PERCPU_ARRAY(percpu, struct row, 4);
"""


@pytest.fixture
def maps(bpf: None) -> Iterator[Any]:
    from bcc import BPF

    b = BPF(text=PROG)
    try:
        yield b
    finally:
        b.cleanup()


def test_a_range_reads_its_entries_in_index_order_up_to_the_last(maps: Any) -> None:
    t = maps[b"shared"]
    for i in range(8):
        t[ctypes.c_int(i)] = t.Leaf(a=i, b=100 + i)
    size = ctypes.sizeof(t.Leaf)

    def rows(first: int, count: int) -> list[tuple[int, int]]:
        return [struct.unpack("<QQ", v) for v in ArrayRange(t.map_fd, first, count, size).read()]

    assert rows(0, 3) == [(0, 100), (1, 101), (2, 102)]
    assert rows(5, 3) == [(5, 105), (6, 106), (7, 107)]  # ends at the array's last entry (the kernel says ENOENT)
    assert rows(7, 1) == [(7, 107)]
    r = ArrayRange(t.map_fd, 2, 2, size)
    assert r.read() == r.read()  # buffers reused across reads
    with pytest.raises(OSError):
        ArrayRange(t.map_fd, 6, 3, size).read()  # past the end: fewer entries than asked, never a short list


def test_other_ranges_read_in_one_ranges_buffers(maps: Any) -> None:
    """`at`: the latency tick's runs of moved slots, wherever they fall, read in the buffers of one range; a run
    longer than they hold is read in buffers of its own, and the range's own read is unchanged by either."""
    t = maps[b"shared"]
    for i in range(8):
        t[ctypes.c_int(i)] = t.Leaf(a=i, b=100 + i)
    size = ctypes.sizeof(t.Leaf)
    r = ArrayRange(t.map_fd, 0, 2, size)

    def unpack(data: bytes) -> list[tuple[int, int]]:
        return [struct.unpack("<QQ", data[i:i + size]) for i in range(0, len(data), size)]

    assert unpack(r.at(6, 2)) == [(6, 106), (7, 107)]
    assert unpack(r.at(3, 1)) == [(3, 103)]
    assert unpack(r.at(0, 1)) == [(0, 100)]
    assert unpack(r.at(1, 5)) == [(i, 100 + i) for i in range(1, 6)]  # longer than its buffers
    assert r.at(4, 0) == b""
    assert unpack(r.data()) == [(0, 100), (1, 101)]
    with pytest.raises(OSError):
        r.at(7, 2)  # past the end


def test_a_per_cpu_range_holds_every_possible_cpu(maps: Any) -> None:
    t = maps[b"percpu"]
    ncpu = t.total_cpu  # bcc sizes per-CPU values by the possible CPUs, as the kernel does
    t[ctypes.c_int(1)] = t.Leaf(*[t.sLeaf(a=c + 1, b=10 * (c + 1)) for c in range(ncpu)])
    [v0, v1] = ArrayRange(t.map_fd, 0, 2, ctypes.sizeof(t.sLeaf) * ncpu).read()
    assert v0 == bytes(len(v0))
    q = struct.unpack(f"<{2 * ncpu}Q", v1)
    assert sum(q[0::2]) == ncpu * (ncpu + 1) // 2 and sum(q[1::2]) == 10 * ncpu * (ncpu + 1) // 2
