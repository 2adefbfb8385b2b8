"""Host trees for placement tests, built in tmp_path: NUMA nodes, PCI devices, /proc entries and cgroups."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from qosagent.gpu.fake import _H200X8_BUSES


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def numa_tree(root: Path, nodes: Mapping[int, str], online: str, mem_kb: int = 64 << 20,
              distances: Mapping[int, Sequence[int]] | None = None) -> Path:
    """Nodes (id -> cpulist) under /sys/devices/system/node, as sysfs lays them out."""
    _write(root, "/sys/devices/system/cpu/online", online + "\n")
    for i, cpus in nodes.items():
        base = f"/sys/devices/system/node/node{i}"
        _write(root, f"{base}/cpulist", cpus + "\n")
        _write(root, f"{base}/meminfo", f"Node {i} MemTotal:       {mem_kb} kB\nNode {i} MemFree:  1 kB\n")
        if distances:
            _write(root, f"{base}/distance", " ".join(map(str, distances[i])) + "\n")
    return root


def pci_device(root: Path, bus: str, vendor: str, klass: str, numa_node: int, local_cpulist: str) -> None:
    # sysfs keeps devices under /sys/devices and links them from /sys/bus/pci/devices.
    dev = root / "sys/devices/pci0000:00" / bus
    for name, value in (("vendor", vendor), ("class", klass), ("numa_node", str(numa_node)),
                        ("local_cpulist", local_cpulist)):
        _write(root, f"/sys/devices/pci0000:00/{bus}/{name}", value + "\n")
    link = root / "sys/bus/pci/devices" / bus
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path("../../../devices/pci0000:00") / bus)
    assert link.resolve() == dev.resolve()


def two_socket_8gpu(root: Path) -> Path:
    """An HGX-like host: 2 nodes of 48 CPUs, GPUs 0-3 on node 0 and 4-7 on node 1 (the fake h200x8's bus ids),
    an NVSwitch (a bridge, not an accelerator) and a NIC."""
    numa_tree(root, {0: "0-47", 1: "48-95"}, "0-95", distances={0: [10, 21], 1: [21, 10]})
    for i, bus in enumerate(_H200X8_BUSES):
        node = i // 4
        pci_device(root, bus, "0x10de", "0x030200", node, "0-47" if node == 0 else "48-95")
    pci_device(root, "0000:05:00.0", "0x10de", "0x068000", 0, "0-47")  # NVSwitch
    pci_device(root, "0000:c1:00.0", "0x15b3", "0x020000", 1, "48-95")  # NIC
    return root


def proc_entry(root: Path, pid: int, cmdline: Sequence[str], comm: str, cgroup: str = "/",
               threads: Mapping[int, str] | None = None, start: int = 1000, numa_maps: str = "") -> None:
    base = f"/proc/{pid}"
    _write(root, f"{base}/cmdline", "\0".join(cmdline) + "\0")
    _write(root, f"{base}/comm", comm + "\n")
    _write(root, f"{base}/cgroup", f"0::{cgroup}\n")
    # Field 22 is the start time; comm in parentheses may itself hold ") ".
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10
    _write(root, f"{base}/stat", f"{pid} ({comm}) {' '.join(fields)}\n")
    for tid, cpus in (threads or {pid: "0-95"}).items():
        _write(root, f"{base}/task/{tid}/status", f"Name:\t{comm}\nCpus_allowed_list:\t{cpus}\n")
    if numa_maps:
        _write(root, f"{base}/numa_maps", numa_maps)


def cpuset(root: Path, cgroup: str, cpus: str) -> None:
    _write(root, f"/sys/fs/cgroup{cgroup}/cpuset.cpus.effective", cpus + "\n")
