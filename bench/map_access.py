"""Map reads through qosagent.ebpf.maps (libbpf's functions) against bcc's own calls for the same reads, same run.

What the latency tick reads (rows of 4872 bytes, struct lat_row, the slots in use as one batch) and what quota's
adoption reads (tenant_ports, a 65536-entry array, in 16 batches), each read ROUNDS x REPEAT times, interleaved,
median per read. Baseline: libbcc's bpf_lookup_batch (the path the agent took before) on the same buffers; also one
lookup per entry (bcc's table indexing), which is what a batch saves.

Run as root from the checkout: python bench/map_access.py. Prints a Markdown section for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import ctypes as ct
import errno
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qosagent.ebpf.maps import ArrayRange, BatchReader, Map  # noqa: E402
from qosagent.ebpf.tenant_ports import PORTS, PortTenant  # noqa: E402
from qosagent.hist import NBUCKETS  # noqa: E402

ROUNDS, REPEAT = 15, 40
ROWS = 4 * 9  # LAT_KINDS x (8 tenants + unmatched traffic)
PROG = f"""
struct row {{ u64 sum_ns; u64 count[{NBUCKETS}]; }};
struct port_tenant {{ u32 tenant; u16 slot; u16 pad; }};
BPF_ARRAY(rows, struct row, 4 * 64 + 1);
BPF_ARRAY(ports, struct port_tenant, {PORTS});
"""


class BccRange:
    """The same read as ArrayRange through libbcc's bpf_lookup_batch (the agent's path before ebpf.maps)."""

    def __init__(self, fd: int, count: int, size: int):
        from bcc.libbcc import lib

        self.lib, self.fd, self.count, self.size = lib, fd, count, size
        self.keys = ct.create_string_buffer(4 * count)
        self.values = ct.create_string_buffer(size * count)
        self.out = ct.c_uint32(0)

    def read(self) -> list[bytes]:
        n = ct.c_uint32(self.count)
        res = self.lib.bpf_lookup_batch(self.fd, None, ct.byref(self.out), self.keys, self.values, ct.byref(n))
        if res != 0 and ct.get_errno() != errno.ENOENT:
            raise OSError(ct.get_errno(), "bpf_lookup_batch")
        raw = self.values.raw
        return [raw[i * self.size:(i + 1) * self.size] for i in range(n.value)]


def bcc_chunks(fd: int, chunk: int, ksize: int, vsize: int) -> int:
    """Every entry of an array through libbcc's bpf_lookup_batch in chunks; the entries read."""
    from bcc.libbcc import lib

    keys, values = ct.create_string_buffer(ksize * chunk), ct.create_string_buffer(vsize * chunk)
    tin, tout, total, first = ct.c_uint32(0), ct.c_uint32(0), 0, True
    while True:
        n = ct.c_uint32(chunk)
        res = lib.bpf_lookup_batch(fd, None if first else ct.byref(tin), ct.byref(tout), keys, values, ct.byref(n))
        total += n.value
        _ = values.raw[:n.value * vsize]
        if res != 0:
            return total
        tin.value, first = tout.value, False


def ours_chunks(fd: int, chunk: int, ksize: int, vsize: int) -> int:
    return sum(n for _k, _v, n in BatchReader(fd, ksize, vsize, chunk).chunks())


def median_us(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(REPEAT):
                fn()
            times[name].append((time.perf_counter() - t) / REPEAT * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    from bcc import BPF

    b = BPF(text=PROG)
    rows, ports = b[b"rows"], b[b"ports"]
    size = ct.sizeof(rows.Leaf)
    rmap = Map(rows.map_fd, ct.c_uint32, rows.Leaf)
    for i in range(ROWS):
        v = rows.Leaf()
        v.sum_ns, v.count[i % NBUCKETS] = i * 1000, i + 1
        rmap.update(i, v)
    pmap = Map(ports.map_fd, ct.c_uint32, PortTenant)
    for p in range(8000, 8016):
        pmap.update(p, PortTenant(tenant=p, slot=1))
    ours, bcc = ArrayRange(rows.map_fd, 0, ROWS, size), BccRange(rows.map_fd, ROWS, size)
    assert ours.read() == bcc.read()
    assert ours_chunks(ports.map_fd, PORTS // 16, 4, 8) == bcc_chunks(ports.map_fd, PORTS // 16, 4, 8) == PORTS
    tick = median_us({
        "ebpf.maps ArrayRange (libbpf)": ours.read,
        "libbcc bpf_lookup_batch (before)": bcc.read,
        "one lookup per row (bcc table)": lambda: [bytes(rows[ct.c_int(i)]) for i in range(ROWS)],
    })
    adopt = median_us({
        "ebpf.maps BatchReader (libbpf)": lambda: ours_chunks(ports.map_fd, PORTS // 16, 4, 8),
        "libbcc bpf_lookup_batch (before)": lambda: bcc_chunks(ports.map_fd, PORTS // 16, 4, 8),
    })
    b.cleanup()
    print("## Map access (bench/map_access.py)\n")
    print(f"Kernel {platform.release()}, {platform.machine()}, median of {ROUNDS} interleaved rounds of {REPEAT} "
          "reads; ratio against libbcc's batch call in the same run (lower is faster).\n")
    for title, res, base in ((f"latency tick: {ROWS} rows of {size} B", tick, "libbcc bpf_lookup_batch (before)"),
                             (f"tenant_ports read back: {PORTS} entries, 16 batches", adopt,
                              "libbcc bpf_lookup_batch (before)")):
        print(f"| {title} | µs per read | ratio |\n|---|---|---|")
        for name, us in res.items():
            print(f"| {name} | {us:.1f} | {us / res[base]:.2f} |")
        print()


if __name__ == "__main__":
    main()
