"""Serving network namespaces: where a tracked port (Config.tracked_ports) listens outside the agent's own namespace
(a pod behind a veth pair), the addresses each holds, the tenants its processes match, and the host-side veths that
lead into each. One reading for every capability that follows pods (quota's classifier, latency's attribution):
`Follower`, one of the agent's services (qosagent/services.py), scans /proc once per NETNS_EVERY however many ask.

Read from /proc through HostFS (the DaemonSet has hostPID): a process's /proc/PID/ns/net names its namespace by
inode, /proc/PID/net/tcp{,6} lists that namespace's sockets (read by qosagent/listeners.py). The host side of a veth
into a namespace is the link whose peer's namespace id (IFLA_LINK_NETNSID) is the id the agent's namespace gives that
namespace (RTM_GETNSID on a descriptor of /proc/PID/ns/net), which needs CAP_NET_ADMIN in the agent's namespace only,
never setns.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from qosagent import listeners
from qosagent.hostfs import HostFS
from qosagent.pods.model import selects
from qosagent.schedule import Every
from qosagent.services import Service
from qosagent.tenants import tenant_id

if TYPE_CHECKING:
    from pyroute2 import IPRoute

    from qosagent.config import TenantConfig
    from qosagent.pods.model import Pod

# How often serving network namespaces are looked for (a scan of /proc: a stat per process).
NETNS_EVERY = 1.0


@dataclass(frozen=True)
class ServingNs:
    ino: int  # the namespace's inode (what /proc/PID/ns/net links to)
    pid: int  # a process in it that serves a tracked port (for its /proc entries)
    ports: frozenset[int]  # tracked ports listening there
    cmdlines: tuple[str, ...] = field(default=(), compare=False)  # every process in it (for process tenants)
    # Its own addresses, 16 bytes each (IPv4 mapped), loopback and link-local left out: what a server socket there
    # has as its local address when a client reaches it through the network (latency's key for process tenants,
    # bpf/include/lat_state.h lat_netns). Link-local ones name a link, not the pod: every pod has one, reached by no
    # client.
    addrs: frozenset[bytes] = frozenset()
    pids: tuple[int, ...] = field(default=(), compare=False)  # every process in it


_V4_MAPPED = bytes(10) + b"\xff\xff"


def fib_local_v4(lines: Iterable[str]) -> set[bytes]:
    """A namespace's own IPv4 addresses from /proc/PID/net/fib_trie, mapped to 16 bytes: each address whose next
    line is a /32 host LOCAL route (the local table lists those; the main one may repeat them), loopback and
    link-local left out."""
    out, last = set(), ""
    for line in lines:
        f = line.split()
        if len(f) == 2 and f[0] == "|--":
            last = f[1]
        elif f[:3] == ["/32", "host", "LOCAL"] and last:
            try:
                ip = ipaddress.IPv4Address(last)
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local):
                out.add(_V4_MAPPED + ip.packed)
    return out


def if_inet6(lines: Iterable[str]) -> set[bytes]:
    """A namespace's own IPv6 addresses from /proc/PID/net/if_inet6 (32 hex digits first), loopback and link-local
    left out."""
    out = set()
    for line in lines:
        f = line.split()
        try:
            raw = bytes.fromhex(f[0])
        except (IndexError, ValueError):
            continue
        if len(raw) == 16 and not (ip := ipaddress.IPv6Address(raw)).is_loopback and not ip.is_link_local:
            out.add(raw)
    return out


def local_addresses(fs: HostFS, pid: int) -> frozenset[bytes]:
    """The addresses of pid's network namespace, read from /proc without entering it (no setns, no CAP_SYS_ADMIN)."""
    v4 = fs.try_read(f"/proc/{pid}/net/fib_trie") or ""
    v6 = fs.try_read(f"/proc/{pid}/net/if_inet6") or ""
    return frozenset(fib_local_v4(v4.splitlines()) | if_inet6(v6.splitlines()))


# Reading a namespace's socket tables costs ~2 ms even when it holds few sockets (the kernel walks the hash tables
# all namespaces share to find the end), so each namespace's listeners are read again only this often: a namespace
# not serving yet (a server still loading) soon, one serving rarely (its end is seen when its last process goes).
RECHECK_IDLE, RECHECK_SERVING = 2.0, 10.0


@dataclass
class ListenCache:
    """Per namespace inode: (monotonic time read, listening ports, its addresses when it serves a tracked port)."""

    read: dict[int, tuple[float, frozenset[int], frozenset[bytes]]] = field(default_factory=dict)


def serving_namespaces(fs: HostFS, tracked: Iterable[int], own_ino: int, with_cmdlines: bool,
                       cache: ListenCache | None = None, now: float = 0.0) -> dict[int, ServingNs]:
    """Namespaces other than own_ino where a tracked port listens, by inode. With a cache, a namespace's listeners
    are taken from it while they are recent enough (RECHECK_*); a new namespace is always read."""
    tracked = set(tracked)
    members: dict[int, list[int]] = {}
    # Once a second over every process: plain strings, not a Path per process, and the link's text ("net:[INODE]"),
    # which the kernel writes without resolving the namespace's file as a stat does (half the cost here).
    proc = str(fs.path("/proc"))
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            ino = int(os.readlink(f"{proc}/{entry}/ns/net")[5:-1])
        except OSError as e:
            fs.refused("ns_net", e, f"/proc/{entry}/ns/net")  # counted when refused; else it exited
            continue
        except ValueError:
            continue
        if ino != own_ino:
            members.setdefault(ino, []).append(int(entry))
    out = {}
    for ino, pids in members.items():
        # One process's view of the namespace's sockets is every process's: the first readable one is enough.
        # Its addresses are read with its listeners, and only where a tracked port listens: a pod's address is
        # set up before its containers start, and every reading is a few hundred bytes from the kernel.
        hit = cache.read.get(ino) if cache is not None else None
        ports: set[int] | frozenset[int] | None = None
        addrs: frozenset[bytes] = frozenset()
        reader = pids[0]
        if hit is not None and now - hit[0] < (RECHECK_SERVING if hit[1] & tracked else RECHECK_IDLE):
            ports, addrs = hit[1], hit[2]
        else:
            for pid in pids:
                found = listeners.listeners(fs, pid)
                if found is not None:
                    ports = {s.port for s in found}
                    # The one that answered names the namespace: an earlier one has exited since it was listed,
                    # and quota would find no veth through its gone /proc/PID/ns/net.
                    reader = pid
                    addrs = local_addresses(fs, pid) if ports & tracked else frozenset()
                    break
            if cache is not None and ports is not None:
                cache.read[ino] = (now, frozenset(ports), addrs)
        if not ports or not ports & tracked:
            continue
        cmdlines: tuple[str, ...] = ()
        if with_cmdlines:
            cmdlines = tuple(c.replace("\0", " ").strip() for c in
                             (fs.try_read(f"/proc/{p}/cmdline") for p in pids) if c)
        out[ino] = ServingNs(ino, reader, frozenset(ports & tracked), cmdlines, addrs, tuple(pids))
    if cache is not None:
        for gone in cache.read.keys() - members.keys():
            del cache.read[gone]
    return out


def host_veths(ipr: "IPRoute", links: Iterable[Any], fs: HostFS, ns: ServingNs) -> list[tuple[int, str]]:
    """(ifindex, name) of the links in the agent's namespace whose peer lies in ns ([] when its process is gone),
    among `links`, a dump of them through ipr made before: a link dump gives each peer namespace an id (the kernel
    allocates it when it reports a link), which then stands as long as that namespace."""
    try:
        fd = os.open(fs.path(f"/proc/{ns.pid}/ns/net"), os.O_RDONLY)
    except OSError as e:
        fs.refused("ns_net", e, f"/proc/{ns.pid}/ns/net")
        return []
    try:
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


class Follower(Service):
    """The serving namespaces as of the last scan, scanned again when NETNS_EVERY has passed or the tracked ports or
    the need for command lines (process rules) changed: quota and latency each ask when they follow pods, and one
    scan serves both. What each makes of the namespaces is in its own part; the scan has none of its own."""

    name = "netns.serving"

    @classmethod
    def make(cls, fs: HostFS, clock: Callable[[], float]) -> "Follower":
        return cls(fs)

    def __init__(self, fs: HostFS, own: int | None = None):
        self.fs = fs
        self.own = own if own is not None else os.stat("/proc/self/ns/net").st_ino  # the agent's own is no pod
        self._every = Every(NETNS_EVERY)
        self._listeners = ListenCache()
        self._asked: tuple[frozenset[int], bool] | None = None
        self.found: dict[int, ServingNs] = {}

    def current(self, tracked: Iterable[int], cmdlines: bool, now: float) -> dict[int, ServingNs]:
        """The namespaces where one of `tracked` listens; with `cmdlines`, their processes' command lines too."""
        asked = (frozenset(tracked), cmdlines)
        if asked != self._asked:
            self._every.again()
            if self._asked is not None and asked[0] != self._asked[0]:
                # Other ports (a reload): every namespace's listeners read afresh, not taken from the cache, where
                # a serving namespace's stay for RECHECK_SERVING and would not show a port it listens on since.
                self._listeners = ListenCache()
        if self._every.due(now):
            self.found = serving_namespaces(self.fs, asked[0], self.own, asked[1], self._listeners, now)
            self._asked = asked
        return self.found

