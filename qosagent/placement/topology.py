"""The host's NUMA topology and where its accelerators sit, read from sysfs (through HostFS) and NVML.

A node is whatever /sys/devices/system/node lists: node 0 need not exist, a node may have memory and no CPUs. A PCI
device's numa_node of -1 means the firmware did not say; it stays unknown (None) unless NVML knows better, and is
never read as node 0.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from qosagent.gpu.backend import GpuDevice, normalize_bus_id
from qosagent.hostfs import HostFS
from qosagent.cpulist import format_cpulist, parse_cpulist

log = logging.getLogger("qosagent.placement")

NODE_DIR = "/sys/devices/system/node"
PCI_DIR = "/sys/bus/pci/devices"
NVIDIA = "0x10de"
# PCI class (base, sub) pairs of devices that compute: VGA and 3D controllers, other display, processing accelerators.
ACCEL_CLASSES = {"0300": "display", "0302": "3d", "0380": "display", "1200": "accelerator"}


@dataclass(frozen=True)
class Node:
    id: int
    cpus: frozenset[int]
    memory_kb: int | None
    distances: tuple[tuple[int, int], ...] = ()  # (other node, distance)

    @property
    def has_memory(self) -> bool:
        # No meminfo to say otherwise: a node is assumed to hold memory (memory-only nodes do list theirs).
        return self.memory_kb is None or self.memory_kb > 0


@dataclass(frozen=True)
class Accelerator:
    bus_id: str  # sysfs form
    vendor: str
    kind: str  # gpu (NVIDIA), display, 3d, accelerator
    sysfs_node: int | None  # None: absent or -1 (the firmware did not say)
    local_cpus: frozenset[int] | None
    gpu_index: int | None = None  # NVML's index, when NVML knows this device
    nvml_cpus: frozenset[int] | None = None
    nvml_node: int | None = None
    node: int | None = None  # the node placement uses, see locate()
    node_source: str = "unknown"  # sysfs | nvml-memory | nvml-cpus | unknown
    warning: str = ""


@dataclass(frozen=True)
class Topology:
    nodes: dict[int, Node]
    accelerators: tuple[Accelerator, ...]
    online_cpus: frozenset[int]
    numa: bool = True  # False: no node directory (a kernel without NUMA); one pseudo node holds every CPU
    warnings: tuple[str, ...] = ()

    def node_of_cpus(self, cpus: Iterable[int]) -> int | None:
        """The one node holding all of cpus, or None when they span nodes or lie on none."""
        want = frozenset(cpus)
        holders = [n.id for n in self.nodes.values() if want and want <= n.cpus]
        return holders[0] if len(holders) == 1 else None

    def gpu(self, index: int) -> Accelerator | None:
        for a in self.accelerators:
            if a.gpu_index == index:
                return a
        return None

    def memory_nodes(self) -> list[int]:
        return sorted(n.id for n in self.nodes.values() if n.has_memory)

    def as_dict(self) -> dict[str, Any]:
        def acc(a: Accelerator) -> dict[str, Any]:
            d = asdict(a)
            for k in ("local_cpus", "nvml_cpus"):
                d[k] = format_cpulist(d[k]) if d[k] is not None else None
            return d

        return {
            "numa": self.numa,
            "online_cpus": format_cpulist(self.online_cpus),
            "nodes": [
                {"id": n.id, "cpus": format_cpulist(n.cpus), "memory_kb": n.memory_kb,
                 "distances": {str(o): d for o, d in n.distances}}
                for n in sorted(self.nodes.values(), key=lambda n: n.id)
            ],
            "accelerators": [acc(a) for a in self.accelerators],
            "warnings": list(self.warnings),
        }


def _cpus(fs: HostFS, path: str) -> frozenset[int] | None:
    text = fs.try_read(path)
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        log.warning("%s: unreadable cpulist %r", path, text[:40])
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _memory_kb(fs: HostFS, node: int) -> int | None:
    for line in (fs.try_read(f"{NODE_DIR}/node{node}/meminfo") or "").splitlines():
        # "Node 0 MemTotal:       134182340 kB"
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "MemTotal:":
            return _int(parts[3])
    return None


def read_nodes(fs: HostFS, online: frozenset[int]) -> dict[int, Node]:
    ids = sorted(int(n[4:]) for n in fs.listdir(NODE_DIR) if n.startswith("node") and n[4:].isdigit())
    nodes: dict[int, Node] = {}
    for i in ids:
        cpus = _cpus(fs, f"{NODE_DIR}/node{i}/cpulist") or frozenset()
        # sysfs lists each node's distances in the order of the node ids, one per node.
        raw = (fs.try_read(f"{NODE_DIR}/node{i}/distance") or "").split()
        dist: tuple[tuple[int, int], ...] = ()
        if len(raw) == len(ids):
            dist = tuple((o, d) for o, d in zip(ids, (_int(x) for x in raw)) if d is not None)
        nodes[i] = Node(i, cpus & online if online else cpus, _memory_kb(fs, i), dist)
    return nodes


def read_accelerators(fs: HostFS) -> list[Accelerator]:
    out = []
    for dev in fs.glob(PCI_DIR, "*"):
        vendor = (fs.try_read(f"{dev}/vendor") or "").lower()
        klass = (fs.try_read(f"{dev}/class") or "").lower().removeprefix("0x")
        kind = ACCEL_CLASSES.get(klass[:4])
        if kind is None:
            continue
        if vendor == NVIDIA:
            kind = "gpu"
        node = _int(fs.try_read(f"{dev}/numa_node"))
        out.append(Accelerator(
            bus_id=normalize_bus_id(dev.rsplit("/", 1)[1]),
            vendor=vendor,
            kind=kind,
            sysfs_node=node if node is not None and node >= 0 else None,
            local_cpus=_cpus(fs, f"{dev}/local_cpulist"),
        ))
    return out


def locate(acc: Accelerator, nodes: dict[int, Node]) -> Accelerator:
    """Which node an accelerator is on: sysfs first, then NVML's memory affinity, then NVML's CPU affinity.

    Unknown stays unknown (node None, with a warning): placing next to a guessed node is worse than not placing."""
    def on(node: int | None, source: str, warning: str = "") -> Accelerator:
        d = {**acc.__dict__, "node": node, "node_source": source, "warning": warning}
        return Accelerator(**d)

    if acc.sysfs_node is not None:
        warn = ""
        if acc.nvml_node is not None and acc.nvml_node != acc.sysfs_node:
            warn = f"NVML says node {acc.nvml_node}, sysfs says {acc.sysfs_node}; using sysfs"
        return on(acc.sysfs_node, "sysfs", warn)
    if acc.nvml_node is not None:
        return on(acc.nvml_node, "nvml-memory")
    if acc.nvml_cpus:
        holders = [n.id for n in nodes.values() if n.cpus and acc.nvml_cpus <= n.cpus]
        if len(holders) == 1:
            return on(holders[0], "nvml-cpus")
    return on(None, "unknown", f"{acc.bus_id}: NUMA node unknown (sysfs numa_node -1 and no NVML affinity): "
                               "processes on it are not pinned")


def read_topology(fs: HostFS, gpus: Iterable[GpuDevice] = ()) -> Topology:
    warnings: list[str] = []
    online = _cpus(fs, "/sys/devices/system/cpu/online") or frozenset()
    nodes = read_nodes(fs, online)
    numa = bool(nodes)
    if not numa:
        # No node directory at all: a kernel built without NUMA. One memory domain; migration means nothing.
        nodes = {0: Node(0, online, None)}
        warnings.append("no NUMA nodes in sysfs: one memory domain assumed, memory is never migrated")
    accs = {a.bus_id: a for a in read_accelerators(fs)}
    for dev in gpus:
        bus = normalize_bus_id(dev.pci_bus_id) if dev.pci_bus_id else ""
        nvml = {"gpu_index": dev.index, "nvml_node": dev.numa_node,
                "nvml_cpus": frozenset(dev.cpu_affinity) if dev.cpu_affinity else None}
        if bus in accs:
            accs[bus] = Accelerator(**{**accs[bus].__dict__, **nvml})
        else:
            # NVML sees a GPU sysfs does not show (a container without the PCI tree, a fake backend): keep NVML's word.
            key = bus or f"nvml:{dev.index}"
            accs[key] = Accelerator(key, NVIDIA, "gpu", None, None, **nvml)
    located = [locate(a, nodes) for a in sorted(accs.values(), key=lambda a: a.bus_id)]
    for a in located:
        if a.warning:
            warnings.append(a.warning)
        if a.node is not None and a.node not in nodes:
            warnings.append(f"{a.bus_id}: on node {a.node}, which sysfs does not list")
    return Topology(nodes, tuple(located), online, numa, tuple(warnings))


def render(topo: Topology) -> str:
    lines = ["NODE  CPUS             MEMORY      DISTANCES"]
    for n in sorted(topo.nodes.values(), key=lambda n: n.id):
        mem = f"{n.memory_kb / 1048576:.1f} GiB" if n.memory_kb else "-"
        dist = " ".join(f"{o}:{d}" for o, d in n.distances) or "-"
        lines.append(f"{n.id:<5} {format_cpulist(n.cpus) or '-':<16} {mem:<11} {dist}")
    lines += ["", "ACCELERATOR     KIND         GPU  NODE  SOURCE        LOCAL CPUS"]
    if not topo.accelerators:
        lines.append("(none)")
    for a in topo.accelerators:
        gpu = "-" if a.gpu_index is None else str(a.gpu_index)
        node = "?" if a.node is None else str(a.node)
        lines.append(f"{a.bus_id:<15} {a.kind:<12} {gpu:<4} {node:<5} {a.node_source:<13} "
                     f"{format_cpulist(a.local_cpus if a.local_cpus is not None else a.nvml_cpus)}")
    for w in topo.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
