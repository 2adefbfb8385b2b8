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
from qosagent.pods.model import selects
from qosagent.tenants import tenant_id

if TYPE_CHECKING:
    from pyroute2 import IPRoute

    from qosagent.config import TenantConfig
    from qosagent.pods.model import Pod

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


@dataclass(frozen=True)
class ServingNs:
    ino: int  # the namespace's inode (what /proc/PID/ns/net links to)
    pid: int  # a process in it that serves a watched port (for its /proc entries)
    ports: frozenset[int]  # watched ports listening there
    cmdlines: tuple[str, ...] = field(default=(), compare=False)  # every process in it (for process tenants)


def listening_ports(lines: Iterable[str]) -> set[int]:
    """Local ports in LISTEN state from the lines of /proc/net/tcp or tcp6. The kernel lists listeners before
    every other socket, so the first row in another state ends them: a busy server's thousands of connections
    are never read (reading them all cost ~13 ms for 2 800 sockets here, once a second per namespace)."""
    out = set()
    for line in lines:
        f = line.split()
        if len(f) < 4 or f[0] == "sl":
            continue
        if f[3] != LISTEN:
            break
        try:
            out.add(int(f[1].rsplit(":", 1)[1], 16))
        except (IndexError, ValueError):
            continue
    return out


def _listening(fs: HostFS, pid: int) -> set[int] | None:
    """Listening ports of pid's namespace (tcp and tcp6), None when its /proc entries are gone."""
    out: set[int] = set()
    seen = False
    for name in ("tcp", "tcp6"):
        try:
            with open(fs.path(f"/proc/{pid}/net/{name}"), encoding="ascii", errors="replace") as f:
                out |= listening_ports(f)
                seen = True
        except OSError:
            continue
    return out if seen else None


# Reading a namespace's socket tables costs ~2 ms even when it holds few sockets (the kernel walks the hash tables
# all namespaces share to find the end), so each namespace's listeners are read again only this often: a namespace
# not serving yet (a server still loading) soon, one serving rarely (its end is seen when its last process goes).
RECHECK_IDLE, RECHECK_SERVING = 2.0, 10.0


@dataclass
class ListenCache:
    """Per namespace inode: (monotonic time read, listening ports)."""

    read: dict[int, tuple[float, frozenset[int]]] = field(default_factory=dict)


def serving_namespaces(fs: HostFS, watched: Iterable[int], own_ino: int, with_cmdlines: bool,
                       cache: ListenCache | None = None, now: float = 0.0) -> dict[int, ServingNs]:
    """Namespaces other than own_ino where a watched port listens, by inode. With a cache, a namespace's listeners
    are taken from it while they are recent enough (RECHECK_*); a new namespace is always read."""
    watched = set(watched)
    members: dict[int, list[int]] = {}
    # Once a second over every process: plain strings and os.stat, not a Path per process.
    proc = str(fs.path("/proc"))
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            ino = os.stat(f"{proc}/{entry}/ns/net").st_ino
        except OSError:
            continue  # exited, or a kernel thread's
        if ino != own_ino:
            members.setdefault(ino, []).append(int(entry))
    out = {}
    for ino, pids in members.items():
        # One process's view of the namespace's sockets is every process's: the first readable one is enough.
        hit = cache.read.get(ino) if cache is not None else None
        ports: set[int] | frozenset[int] | None = None
        if hit is not None and now - hit[0] < (RECHECK_SERVING if hit[1] & watched else RECHECK_IDLE):
            ports = hit[1]
        else:
            for pid in pids:
                ports = _listening(fs, pid)
                if ports is not None:
                    break
            if cache is not None and ports is not None:
                cache.read[ino] = (now, frozenset(ports))
        if not ports or not ports & watched:
            continue
        cmdlines: tuple[str, ...] = ()
        if with_cmdlines:
            cmdlines = tuple(c.replace("\0", " ").strip() for c in
                             (fs.try_read(f"/proc/{p}/cmdline") for p in pids) if c)
        out[ino] = ServingNs(ino, pids[0], frozenset(ports & watched), cmdlines)
    if cache is not None:
        for gone in cache.read.keys() - members.keys():
            del cache.read[gone]
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


@dataclass(frozen=True)
class NsRule:
    """A tenant matched per serving network namespace, on ports (none: every watched port): by a command line of a
    process in it (process), or by the pod it belongs to (pod_namespace, pod_labels)."""

    tenant: int
    ports: tuple[int, ...]
    process: str | None = None
    pod_namespace: str | None = None
    pod_labels: tuple[tuple[str, str], ...] = ()

    @property
    def by_pod(self) -> bool:
        return self.process is None


def ns_rules(tenants: Iterable["TenantConfig"]) -> list[NsRule]:
    """The per-namespace rules of the tenants, in config order (the first rule wins a port)."""
    out = []
    for t in tenants:
        m = t.match
        if m.process is not None:
            out.append(NsRule(tenant_id(t.name), tuple(m.ports), process=m.process))
        elif m.pods is not None:
            out.append(NsRule(tenant_id(t.name), tuple(m.ports), pod_namespace=m.pods.namespace,
                              pod_labels=tuple(sorted(m.pods.labels.items()))))
    return out


def namespace_tenants(rules: Iterable[NsRule], ns: ServingNs, pod: "Pod | None") -> dict[int, int]:
    """port (0: any watched port) -> tenant id in ns, for the rules it matches: by its processes' command lines,
    or by its pod (None: not known, which no pods rule matches); the first rule wins a port."""
    out: dict[int, int] = {}
    for rule in rules:
        if rule.process is not None:
            r = re.compile(rule.process)
            hit = any(r.search(c) for c in ns.cmdlines)
        else:
            hit = pod is not None and selects(pod, rule.pod_namespace, dict(rule.pod_labels))
        if hit:
            for p in rule.ports or (0,):
                out.setdefault(p, rule.tenant)
    return out
