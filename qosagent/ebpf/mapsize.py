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

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from qosagent.cpulist import parse_cpulist

if TYPE_CHECKING:
    from qosagent.hostfs import HostFS

ARRAY, PERCPU_ARRAY, HASH, PERCPU_HASH = "array", "percpu_array", "hash", "percpu_hash"
BUCKETS = "buckets"  # a hash map made BPF_F_NO_PREALLOC: its bucket array is made whole, its entries as inserted

log = logging.getLogger("qosagent.ebpf")

_fallback_warned = False  # a fallback from the possible-CPU file is logged once a process, not at every sizing
_fallback_lock = threading.Lock()


def _highest_cpu(fs: "HostFS", host_path: str) -> int | None:
    try:
        cpus = parse_cpulist(fs.try_read(host_path) or "")
    except ValueError:
        return None
    return max(cpus) + 1 if cpus else None


def possible_cpus(fs: "HostFS") -> int:
    """The CPUs the kernel may ever bring up (/sys/devices/system/cpu/possible): per-CPU maps hold one copy each, and
    quota's stats generations (quota_gen) one line each.

    Unreadable, the highest present CPU + 1 stands in, else os.cpu_count() (online CPUs): both may be fewer than the
    possible ones, and a CPU numbered past them then shares a generation line with a lower one (`cpu % count`), so
    the fallback is logged, once."""
    n = _highest_cpu(fs, "/sys/devices/system/cpu/possible")
    if n is not None:
        return n
    n = _highest_cpu(fs, "/sys/devices/system/cpu/present")
    source = "the highest present CPU + 1"
    if n is None:
        n, source = os.cpu_count() or 1, "the online CPU count"
    global _fallback_warned
    with _fallback_lock:
        warn, _fallback_warned = not _fallback_warned, True
    if warn:
        log.warning("%s unreadable: sizing per-CPU maps and quota's stats generations for %d CPUs (%s); a CPU "
                    "numbered past them shares a generation line with a lower one",
                    fs.path("/sys/devices/system/cpu/possible"), n, source)
    return n


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
