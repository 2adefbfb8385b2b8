"""What BPF maps cost in kernel memory, worked out before they exist (`qosagent check`), and the CPU count per-CPU
maps multiply by.

The kernel allocates arrays and (unless BPF_F_NO_PREALLOC) hash maps whole when the map is made; a per-CPU value
is one copy per possible CPU. Per entry, as 6.18 reports it in a map fd's `memlock` (measured here):
array r8(V); per-CPU array 8 + C·r8(V); hash and LRU hash 64 + r8(K) + r8(V); per-CPU hash 72 + r8(K) + C·r8(V),
where r8 rounds up to 8 bytes and C is the possible CPUs; a hash map made BPF_F_NO_PREALLOC 16 for its bucket, its
entries as they are inserted. An LPM trie allocates per entry inserted: its size is what the config puts in it, not
counted here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from qosagent.cpulist import parse_cpulist

if TYPE_CHECKING:
    from qosagent.hostfs import HostFS

ARRAY, PERCPU_ARRAY, HASH, PERCPU_HASH = "array", "percpu_array", "hash", "percpu_hash"
BUCKETS = "buckets"  # a hash map made BPF_F_NO_PREALLOC: its bucket array is made whole, its entries as inserted


def possible_cpus(fs: "HostFS") -> int:
    """The CPUs the kernel may ever bring up (/sys/devices/system/cpu/possible): per-CPU maps hold one copy each."""
    text = fs.try_read("/sys/devices/system/cpu/possible")
    try:
        cpus = parse_cpulist(text or "")
    except ValueError:
        cpus = frozenset()
    return max(cpus) + 1 if cpus else os.cpu_count() or 1


def _r8(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class MapSize:
    name: str
    kind: str
    entries: int
    key: int
    value: int

    def bytes(self, cpus: int) -> int:
        per = {ARRAY: _r8(self.value), PERCPU_ARRAY: 8 + cpus * _r8(self.value),
               HASH: 64 + _r8(self.key) + _r8(self.value),
               PERCPU_HASH: 72 + _r8(self.key) + cpus * _r8(self.value), BUCKETS: 16}[self.kind]
        return self.entries * per


def total(maps: Iterable[MapSize], cpus: int) -> int:
    return sum(m.bytes(cpus) for m in maps)


def render(name: str, maps: list[MapSize], cpus: int, largest: int = 3) -> str:
    """`name  12.3 MB  (a 8.0 MB, b 3.1 MB, ...)`: the total and its largest maps."""
    sizes = sorted(((m.bytes(cpus), m.name) for m in maps), reverse=True)
    parts = ", ".join(f"{n} {b / 2**20:.1f} MB" for b, n in sizes[:largest])
    return f"{name:<12} {total(maps, cpus) / 2**20:6.1f} MB  ({parts})"
