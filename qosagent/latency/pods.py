"""Process and pods tenants (match.process, match.pods) in latency: a pod's connections attributed by the address
they were made to.

The quota classifier tells serving network namespaces apart by the host-side veth a request leaves through; the
latency probes see a connection where it is established (the inet_sock_set_state tracepoint, sock_ops, or the first
segment of an adopted one), and all any of them carry is the socket's addresses and ports: tracing programs are
refused bpf_get_netns_cookie (checked on 6.18: sock_ops and cgroup_skb may call it, raw tracepoints may not), and a
socket's namespace is otherwise only in kernel structs we do not read. A pod's own addresses are its name there:
lat_netns maps (local address, port or 0 for any tracked port) to the tenant of the namespace that holds the address.

The namespaces come from the agent's one scan of /proc (qosagent.netns.Follower, shared with quota), their addresses
from /proc/PID/net without entering them. An address two serving namespaces both hold (isolated networks reusing a
range) cannot say which one a connection went to: it is left out, reported, and such connections stay unmatched
rather than counted under a guessed tenant.
"""

from __future__ import annotations

import ipaddress
import logging
import struct
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from qosagent import netns
from qosagent import services as services_mod
from qosagent.ebpf.maps import Map, sync
from qosagent.pods.service import Pods

if TYPE_CHECKING:
    from qosagent.hostfs import HostFS
    from qosagent.pods.config import PodsConfig
    from qosagent.pods.model import Pod

log = logging.getLogger("qosagent.latency")

Key = tuple[bytes, int]  # (16-byte local address, port or 0)
MAX_ENTRIES = 4096  # LAT_NETNS_MAX of bpf/include/lat_state.h: 1000 pods with two addresses on two ports each


def entries(found: Mapping[int, netns.ServingNs], rules: Iterable[netns.NsRule], tracked: Iterable[int],
            pod_in: "Callable[[int], Pod | None]" = lambda ino: None
            ) -> tuple[dict[Key, int], dict[int, dict[int, int]], set[bytes]]:
    """What lat_netns holds for these namespaces: (address, port) -> tenant, a tenant of any tracked port (0) entered
    under each of them (one lookup in the kernel, not two); each namespace's tenants by port (as
    netns.namespace_tenants gives them, with its pod from pod_in); and the addresses left out because two namespaces
    hold them."""
    tracked = sorted(tracked)
    rules = list(rules)
    owners: dict[bytes, set[int]] = {}
    for ino, ns in found.items():
        for a in ns.addrs:
            owners.setdefault(a, set()).add(ino)
    shared = {a for a, inos in owners.items() if len(inos) > 1}
    out: dict[Key, int] = {}
    tenants: dict[int, dict[int, int]] = {}
    for ino, ns in sorted(found.items()):
        by_port = netns.namespace_tenants(rules, ns, pod_in(ino))
        if not by_port:
            continue
        tenants[ino] = by_port
        for a in ns.addrs - shared:
            for port, tid in by_port.items():
                for p in [port] if port else tracked:
                    out.setdefault((a, p), tid)  # a tenant of that port before one of any port
    return out, tenants, shared & {a for ino in tenants for a in found[ino].addrs}


def show(addr: bytes) -> str:
    ip = ipaddress.IPv6Address(addr)
    return str(ip.ipv4_mapped or ip)


class PodTenants:
    """lat_netns kept as the serving namespaces and the config's process and pods rules say; `followed` is what status
    shows."""

    def __init__(self, services: dict[str, Any], fs: "HostFS", table: "Map", conf: "Map",
                 clock: Callable[[], float]):
        self.services, self.fs, self.table, self.conf, self.clock = services, fs, table, conf, clock
        self.written: dict[Key, int] = {}
        self.overflow = 0  # entries wanted when more than MAX_ENTRIES, as last warned of
        self.followed: tuple[dict[str, Any], ...] = ()

    def follow(self, rules: Iterable[netns.NsRule], tracked: Iterable[int], now: float,
               names: Mapping[int, str], pods_config: "PodsConfig", starting: bool = False) -> bool:
        """Bring lat_netns up to date; True when it changed. Without process or pods rules nothing is scanned for
        it. A namespace's pod comes from the agent's one listing of the runtime's pods (the Pods service), the one
        quota uses too: any serving namespace, with or without quota, a veth or a classified port."""
        rules, tracked = list(rules), list(tracked)
        found = (services_mod.shared(self.services, netns.Follower, self.fs, self.clock).current(
            tracked, any(not r.by_pod for r in rules), now) if rules else {})
        pods = services_mod.shared(self.services, Pods, self.fs, self.clock)
        pods.current(any(r.by_pod for r in rules), pods_config, starting)
        want, tenants, shared = entries(found, rules, tracked, lambda ino: pods.pod_of(found[ino]))
        wanted = len(want)
        if wanted > MAX_ENTRIES:
            if wanted != self.overflow:
                log.warning("%d (address, port) entries for process and pods tenants, room for %d: connections to the "
                            "addresses left out count as unmatched", wanted, MAX_ENTRIES)
            want = dict(sorted(want.items())[:MAX_ENTRIES])
        self.overflow = wanted if wanted > MAX_ENTRIES else 0
        followed = tuple({
            "netns": ino, "pid": found[ino].pid, "addresses": sorted(map(show, found[ino].addrs - shared)),
            "shared": sorted(map(show, found[ino].addrs & shared)),
            "pod": pod.ref if (pod := pods.pod_of(found[ino])) is not None else None,
            "tenants": {str(p or "any"): names.get(t, str(t)) for p, t in by_port.items()},
        } for ino, by_port in sorted(tenants.items()))
        if want == self.written and followed == self.followed:
            return False
        if want != self.written:
            k, v = self.table.key, self.table.value
            if not want:
                self.conf.update(0, self.conf.value(entries=0))  # the kernel stops looking before the map empties
            sync(self.table, ((k.from_buffer_copy(struct.pack("=16sHH", a, p, 0)), v(tenant=t))
                              for (a, p), t in want.items()))
            if want:
                self.conf.update(0, self.conf.value(entries=len(want)))
        before = {n["netns"] for n in self.followed}
        for ino in tenants.keys() - before:
            ns = found[ino]
            log.info("network namespace %d (pid %d, %s) attributed by its addresses: %s", ino, ns.pid,
                     ", ".join(sorted(map(show, ns.addrs))) or "no address yet",
                     "; ".join(f"port {p or 'any'}: tenant {names.get(t, t)}" for p, t in tenants[ino].items()))
        for ino in before - tenants.keys():
            log.info("network namespace %d no longer serves here: its addresses removed", ino)
        if shared and {show(a) for a in shared} != {a for n in self.followed for a in n["shared"]}:
            log.warning("addresses held by more than one serving network namespace cannot tell their "
                        "process and pods tenants apart; their connections count as unmatched: %s",
                        ", ".join(sorted(map(show, shared))))
        self.written, self.followed = want, followed
        return True
