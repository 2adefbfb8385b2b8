"""Where quota's classifier sits: the ingress of the interfaces (configured, or found from the listeners on watched
ports) and the egress of the host-side veths into the serving network namespaces it follows."""

from __future__ import annotations

import logging
from typing import Any

from qosagent import listeners, netns
from qosagent.capability import AgentContext
from qosagent.config import Config
from qosagent.hostfs import HostFS
from qosagent.pods.service import Pods
from qosagent.quota.datapath import Datapath
from qosagent.schedule import Every
from qosagent.tenants import TenantInfo

log = logging.getLogger("qosagent.quota")


def interfaces(cfg: Config, fs: HostFS) -> list[str]:
    """quota.interfaces, or lo plus the interfaces whose addresses a listener on a watched port is bound to."""
    if cfg.quota.interfaces:
        return list(cfg.quota.interfaces)
    import psutil

    bound = set()
    for s in listeners.on_ports(fs, cfg.watched_ports()):
        try:
            bound.add(s.address)
        except (ValueError, OSError):
            continue  # a row the kernel would not write
    out = ["lo"]
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name == "lo":
            continue
        ips = {a.address.split("%")[0] for a in addrs if a.family.name in ("AF_INET", "AF_INET6")}
        if ips and (bound & ips or bound & {"0.0.0.0", "::"}):
            out.append(name)
    return out


class NamespaceEgress:
    """The serving network namespaces followed (quota.namespaces; process and pods tenants): the host-side veths
    into each (inode -> (ifindex, name)), where the classifier is on egress, and what status shows of them.
    Namespaces come and go (pods): followed on their own schedule, not by a restart."""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.veths: dict[int, list[tuple[int, str]]] = {}
        self.shown: tuple[dict[str, Any], ...] = ()
        self.every = Every(netns.NETNS_EVERY)
        # What a follow needs of the config, worked out once per config rather than each second.
        self._config: Config | None = None
        self._rules: list[netns.NsRule] = []
        self._ports: tuple[list[int], set[int]] = ([], set())

    def names(self) -> list[str]:
        return [name for vs in self.veths.values() for _, name in vs]

    def follow(self, d: Datapath, attached: list[str], table: dict[int, TenantInfo], starting: bool = False) -> None:
        cfg = self.ctx.config
        if cfg is not self._config:
            self._config = cfg
            self._rules = netns.ns_rules(cfg.tenants)
            self._ports = (cfg.tracked_ports(), set(cfg.watched_ports()))
        rules = self._rules
        pods = self.ctx.service(Pods)
        pods.current(any(r.by_pod for r in rules), cfg.pods, starting)
        found: dict[int, netns.ServingNs] = {}
        veths: dict[int, list[tuple[int, str]]] = {}
        links = d.netlink()
        links.poll()
        # Without a link into another namespace there is no veth to put the classifier on, whatever /proc holds:
        # no scan then, until the kernel announces a link (a pod's veth is made before its server can listen).
        if cfg.quota.namespaces and links.peered():
            tracked, classified = self._ports
            found = self.ctx.service(netns.Follower).current(
                tracked, any(not r.by_pod for r in rules), self.ctx.clock())
            found = {ino: ns for ino, ns in found.items() if ns.ports & classified}
            veths = {ino: v for ino, ns in found.items()
                     if (v := netns.host_veths(links.ipr, links.links(), self.ctx.hostfs, ns))}
        pod = {ino: pods.pod_of(found[ino]) for ino in veths}
        tenants = {ino: netns.namespace_tenants(rules, found[ino], pod[ino]) for ino in veths}
        d.set_netns({(idx, port): tid for ino, vs in veths.items() for idx, _ in vs
                     for port, tid in tenants[ino].items()})
        for line in d.attach(attached, [name for vs in veths.values() for _, name in vs]):
            log.info("%s", line)
        names = {tid: info.name for tid, info in table.items()}
        shown = {ino: {str(p or "any"): names.get(t, str(t)) for p, t in tenants[ino].items()} for ino in veths}
        self._log_changes(found, veths, pod, shown)
        self.veths = veths
        # As status shows them: worked out here, when they change, not in every tick's collect.
        self.shown = tuple({
            "netns": ino, "pid": found[ino].pid, "ports": sorted(found[ino].ports),
            "egress": [n for _, n in vs], "pod": pod[ino].ref if pod[ino] else None, "tenants": shown[ino],
        } for ino, vs in sorted(veths.items()))

    def _log_changes(self, found: dict[int, netns.ServingNs], veths: dict[int, list[tuple[int, str]]],
                     pod: dict[int, Any], shown: dict[int, dict[str, str]]) -> None:
        before = {n["netns"]: n["tenants"] for n in self.shown}
        for ino in veths.keys() - self.veths.keys():
            ns = found[ino]
            log.info("following network namespace %d (pid %d, ports %s%s) through %s%s", ino, ns.pid,
                     ",".join(map(str, sorted(ns.ports))), f", pod {pod[ino].ref}" if pod[ino] else "",
                     ", ".join(n for _, n in veths[ino]), "".join(f"; port {p}: tenant {t}"
                                                                  for p, t in shown[ino].items()))
        for ino in veths.keys() & self.veths.keys():
            if before.get(ino) != shown[ino]:  # its pod became known, or unknown, or changed its labels
                log.info("network namespace %d%s: tenants now %s", ino,
                         f" (pod {pod[ino].ref})" if pod[ino] else "",
                         ", ".join(f"port {p}: {t}" for p, t in shown[ino].items()) or "by port and CIDR")
        for ino in self.veths.keys() - veths.keys():
            log.info("network namespace %d no longer serves here (gone, or its veth is): its rules removed", ino)
