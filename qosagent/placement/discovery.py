"""Which processes are inference servers, and what the host says about each: read from /proc through HostFS.

A process is identified by (pid, start time): a pid the kernel reuses for another program is a new process, so the
agent never restores or re-pins a stranger that inherited an old pid.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from qosagent.cgroups import HostCgroups, read_cpuset
from qosagent.cpulist import parse_cpulist
from qosagent.hostfs import HostFS
from qosagent.listeners import proc_start
from qosagent.placement.config import Selector


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    start: int  # start time in clock ticks since boot (/proc/PID/stat field 22)
    name: str
    cmdline: str
    cgroup: str  # cgroup v2 path (or the v1 cpuset hierarchy's)
    cpuset: frozenset[int] | None  # the CPUs its cgroup allows (kubelet's decision), None when unreadable
    selector: str  # which selector chose it: "selectors[0]", "gpu"
    node_pref: int | None = None  # the selector's node for a process without a GPU
    tenant: str | None = None
    thread_cpus: Mapping[int, frozenset[int]] | None = None  # tid -> Cpus_allowed_list, read at collect


def thread_cpus(fs: HostFS, pid: int) -> dict[int, frozenset[int]]:
    """Cpus_allowed_list of every thread; a thread that exits while it is read is left out."""
    out: dict[int, frozenset[int]] = {}
    for t in fs.listdir(f"/proc/{pid}/task"):
        if not t.isdigit():
            continue
        for line in (fs.try_read(f"/proc/{pid}/task/{t}/status") or "").splitlines():
            if line.startswith("Cpus_allowed_list:"):
                try:
                    out[int(t)] = parse_cpulist(line.split(":", 1)[1])
                except ValueError:
                    pass
                break
    return out


def numa_pages(fs: HostFS, pid: int) -> dict[int, int] | None:
    """Resident pages per node, summed over the mappings of /proc/PID/numa_maps; None when it cannot be read."""
    text = fs.try_read(f"/proc/{pid}/numa_maps")
    if text is None:
        return None
    return parse_numa_maps(text)


def parse_numa_maps(text: str) -> dict[int, int]:
    pages: dict[int, int] = {}
    for line in text.splitlines():
        for tok in line.split()[2:]:
            # "N0=123": pages of this mapping on node 0 (huge pages count as one each; locality is a ratio anyway).
            if tok.startswith("N") and "=" in tok:
                node, _, n = tok[1:].partition("=")
                if node.isdigit() and n.isdigit():
                    pages[int(node)] = pages.get(int(node), 0) + int(n)
    return pages


class Matcher:
    """Compiled selectors; match() is pure over the strings read from /proc."""

    def __init__(self, selectors: Iterable[Selector]):
        self.selectors = [
            (s, re.compile(s.name) if s.name else None, re.compile(s.cmdline) if s.cmdline else None)
            for s in selectors
        ]

    def match(self, name: Callable[[], str], cmdline: Callable[[], str],
              cgroup: Callable[[], str]) -> tuple[int, Selector] | None:
        """The first selector all of whose keys match; each field is read (called) only when a key needs it, so
        the usual cmdline-only selector costs one read per process on the host."""
        for i, (s, name_re, cmd_re) in enumerate(self.selectors):
            if name_re and not name_re.search(name()):
                continue
            if cmd_re and not cmd_re.search(cmdline()):
                continue
            if s.cgroup and not (cgroup() == s.cgroup or cgroup().startswith(s.cgroup.rstrip("/") + "/")):
                continue
            if s.unit and s.unit not in cgroup().split("/"):
                continue
            return i, s
        return None


def discover(fs: HostFS, matcher: Matcher, gpu_pids: Iterable[int] = (), own_pid: int | None = None,
             cgroups: HostCgroups | None = None) -> list[ProcInfo]:
    """Selected processes now running: those a selector matches, and the pids in gpu_pids (already selected).
    Cgroup paths are the host's (`cgroups` rebases them when the agent runs in a cgroup namespace of its own)."""
    wanted_gpu = set(gpu_pids)
    hc = cgroups if cgroups is not None else HostCgroups(fs, own_pid)
    out: list[ProcInfo] = []
    for entry in fs.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == own_pid:
            continue
        cmd_raw = fs.try_read(f"/proc/{pid}/cmdline")
        # Kernel threads have an empty cmdline; they are never ours to move.
        if not cmd_raw:
            continue
        cmdline = cmd_raw.replace("\0", " ").strip()
        name = functools.cache(lambda pid=pid: fs.try_read(f"/proc/{pid}/comm") or "")
        cgroups = functools.cache(lambda pid=pid: hc.of_pid(pid))
        # Selectors name cgroups as systemd and kubelet lay them out: the v2 tree, else v1's systemd hierarchy.
        hit = matcher.match(name, lambda: cmdline, lambda: cgroups()[0] or cgroups()[2] or cgroups()[1])
        if hit is None and pid not in wanted_gpu:
            continue
        v2, v1, systemd = cgroups()
        start = proc_start(fs, pid)
        if start is None:
            continue  # exited while we looked
        i, sel = hit if hit else (None, None)
        out.append(ProcInfo(
            pid=pid, start=start, name=name(), cmdline=cmdline[:200], cgroup=v2 or systemd or v1,
            cpuset=read_cpuset(fs, v2, v1),
            selector=f"selectors[{i}]" if sel is not None else "gpu",
            node_pref=sel.node if sel is not None else None,
            tenant=sel.tenant if sel is not None else None,
            thread_cpus=thread_cpus(fs, pid),
        ))
    return out
