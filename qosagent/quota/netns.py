"""Serving network namespaces: where a watched port listens outside the agent's own namespace (a pod behind a
veth pair), and the host-side veths that lead into each.

Read from /proc through HostFS (the DaemonSet has hostPID): a process's /proc/PID/ns/net names its namespace by
inode, /proc/PID/net/tcp{,6} lists that namespace's sockets. The host side of a veth into a namespace is the link
whose peer's namespace id (IFLA_LINK_NETNSID) is the id the agent's namespace gives that namespace (RTM_GETNSID on
a descriptor of /proc/PID/ns/net), which needs CAP_NET_ADMIN in the agent's namespace only, never setns.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from qosagent.hostfs import HostFS

if TYPE_CHECKING:
    from pyroute2 import IPRoute

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


@dataclass(frozen=True)
class ServingNs:
    ino: int  # the namespace's inode (what /proc/PID/ns/net links to)
    pid: int  # a process in it that serves a watched port (for its /proc entries)
    ports: frozenset[int]  # watched ports listening there
    cmdlines: tuple[str, ...] = field(default=(), compare=False)  # every process in it (for process tenants)


def listening_ports(text: str) -> set[int]:
    """Local ports in LISTEN state from /proc/net/tcp or tcp6 text."""
    out = set()
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) > 3 and f[3] == LISTEN:
            try:
                out.add(int(f[1].rsplit(":", 1)[1], 16))
            except (IndexError, ValueError):
                continue
    return out


def ns_ino(fs: HostFS, pid: int | str) -> int | None:
    try:
        return os.stat(fs.path(f"/proc/{pid}/ns/net")).st_ino
    except OSError:
        return None


def serving_namespaces(fs: HostFS, watched: Iterable[int], own_ino: int, with_cmdlines: bool) -> dict[int, ServingNs]:
    """Namespaces other than own_ino where a watched port listens, by inode."""
    watched = set(watched)
    members: dict[int, list[int]] = {}
    for entry in fs.listdir("/proc"):
        if not entry.isdigit():
            continue
        ino = ns_ino(fs, entry)
        if ino is not None and ino != own_ino:
            members.setdefault(ino, []).append(int(entry))
    out = {}
    for ino, pids in members.items():
        # One process's view of the namespace's sockets is every process's: the first readable one is enough.
        ports: set[int] | None = None
        for pid in pids:
            tcp = [fs.try_read(f"/proc/{pid}/net/{n}") for n in ("tcp", "tcp6")]
            if any(t is not None for t in tcp):
                ports = set().union(*(listening_ports(t) for t in tcp if t))
                break
        if not ports or not ports & watched:
            continue
        cmdlines: tuple[str, ...] = ()
        if with_cmdlines:
            cmdlines = tuple(c.replace("\0", " ").strip() for c in
                             (fs.try_read(f"/proc/{p}/cmdline") for p in pids) if c)
        out[ino] = ServingNs(ino, pid, frozenset(ports & watched), cmdlines)
    return out


def host_veths(ipr: "IPRoute", fs: HostFS, ns: ServingNs) -> list[tuple[int, str]]:
    """(ifindex, name) of the links in the agent's namespace whose peer lies in ns ([] when its process is gone)."""
    try:
        fd = os.open(fs.path(f"/proc/{ns.pid}/ns/net"), os.O_RDONLY)
    except OSError:
        return []
    try:
        # A link dump gives each peer namespace an id first (the kernel allocates it when it reports a link).
        links = ipr.get_links()
        got = ipr.get_netnsid(fd=fd)
    finally:
        os.close(fd)
    nsid = got.get("nsid") if got else None
    if nsid is None or nsid < 0:
        return []
    return sorted((int(link["index"]), str(link.get_attr("IFLA_IFNAME"))) for link in links
                  if link.get_attr("IFLA_LINK_NETNSID") == nsid)


def process_tenants(rules: Iterable[tuple[str, tuple[int, ...], int]], ns: ServingNs) -> dict[int, int]:
    """port (0: any watched port) -> tenant id in ns, for the process rules (regex, ports, tenant) its processes
    match; the first rule wins a port."""
    out: dict[int, int] = {}
    for regex, ports, tid in rules:
        r = re.compile(regex)
        if any(r.search(c) for c in ns.cmdlines):
            for p in ports or (0,):
                out.setdefault(p, tid)
    return out
