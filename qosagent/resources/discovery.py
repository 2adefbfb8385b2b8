"""Which processes serve which tier, and the cgroups they are in.

A tenant's serving processes are those listening on its ports, in every network namespace (a port alone claims it
everywhere, as quota and latency read it), and, for a tenant matched per namespace (match.process, match.pods),
those listening in a namespace its rule matches (the agent's one scan of serving namespaces and one listing of pods:
netns.Follower, pods.service.Pods). Each serving process's cgroup, per controller, is a group; a group is ours to
set only where its processes serve one tier and it is not shared with the rest of the host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from qosagent import listeners
from qosagent.cgroups import V2, HostCgroups, cgroup_dir, cgroup_procs, controller_version
from qosagent.hostfs import HostFS
from qosagent.netns import ServingNs, namespace_tenants, ns_rules
from qosagent.resources.model import CONFLICT, KUBELET, OK, SHARED, UNAVAILABLE, Group, Serving
from qosagent.tenants import tenant_id

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.pods.model import Pod

CONTROLLERS = ("cpu", "memory")
# The agent's own cgroup for a tier's processes moved out of a shared one (move: true).
OWN_PREFIX = "/qosagent-"
# A login session or a user's manager holds everything a user starts; a slice holds other units.
_SHARED_LEAF = re.compile(r"(\.slice|^session-\d+\.scope|^user@\d+\.service|^init\.scope)$")


def own_cgroup(tier: str) -> str:
    return f"{OWN_PREFIX}{tier}"


@dataclass(frozen=True)
class Layout:
    """Where each controller is on this host: V2, "v1", or None (not mounted)."""

    versions: Mapping[str, str | None]

    @staticmethod
    def probe(fs: HostFS) -> "Layout":
        return Layout({c: controller_version(fs, c) for c in CONTROLLERS})

    def kinds(self) -> dict[str, str]:
        """controller -> the /proc/PID/cgroup kind its path is read under (V2, or the v1 controller's name)."""
        return {c: V2 if v == V2 else c for c, v in self.versions.items() if v is not None}


PortTenants = Mapping[int, list[tuple[str, str]]]  # port -> (tenant, tier)


def port_tenants(cfg: "Config") -> dict[int, list[tuple[str, str]]]:
    """port -> (tenant, tier) of the tenants matched on it in every namespace (not per namespace)."""
    out: dict[int, list[tuple[str, str]]] = {}
    for t in cfg.tenants:
        if not t.match.per_namespace:
            for p in t.match.ports:
                out.setdefault(p, []).append((t.name, t.tier))
    return out


def serving(fs: HostFS, cfg: "Config", namespaces: Mapping[int, ServingNs],
            pod_of: Callable[[ServingNs], "Pod | None"], own_pid: int) -> list[Serving]:
    """Every (process, tenant) pair serving a tier that has `resources:`, in pid order."""
    with_resources = {n for n, t in cfg.tiers.items() if t.resources is not None}
    by_port = port_tenants(cfg)
    rules = ns_rules(cfg.tenants)
    names = {tenant_id(t.name): (t.name, t.tier) for t in cfg.tenants}
    hits: dict[tuple[int, str], str] = {}  # (pid, tenant) -> tier

    def take(socks: list[listeners.Listener], pids: Iterable[int], per_port: PortTenants) -> None:
        held = listeners.holders(fs, [s.inode for s in socks], pids, every=True)
        for s in socks:
            for pid in held.get(s.inode, ()):
                for tenant, tier in per_port.get(s.port, ()):
                    if tier in with_resources and pid != own_pid:
                        hits[(pid, tenant)] = tier

    host = listeners.on_ports(fs, by_port)
    if host:
        take(host, listeners.pids(fs), by_port)
    for ns in namespaces.values():
        per_port: dict[int, list[tuple[str, str]]] = {p: list(v) for p, v in by_port.items()}
        for port, tid in namespace_tenants(rules, ns, pod_of(ns) if any(r.by_pod for r in rules) else None).items():
            for p in ([port] if port else ns.ports):
                per_port.setdefault(p, []).append(names[tid])
        socks = listeners.on_ports(fs, per_port, ns.pid)
        if socks:
            take(socks, ns.pids, per_port)
    out = []
    for (pid, tenant), tier in sorted(hits.items()):
        start = listeners.proc_start(fs, pid)
        if start is not None:
            comm = (fs.try_read(f"/proc/{pid}/comm") or "?").strip()
            out.append(Serving(pid, start, comm, tenant, tier))
    return out


def is_shared(path: str) -> bool:
    leaf = path.rstrip("/").rsplit("/", 1)[-1]
    return not path.strip("/") or bool(_SHARED_LEAF.search(leaf))


def groups(fs: HostFS, cgroups: HostCgroups, layout: Layout, procs: Iterable[Serving], kubelet_report: bool,
           own_pid: int) -> list[Group]:
    """The serving processes' cgroups, one group per controller and cgroup, each with its state."""
    kinds = layout.kinds()
    members: dict[tuple[str, str], dict[int, set[str]]] = {}
    for p in procs:
        paths = cgroups.of_pid_kinds(p.pid, tuple(kinds.values()))
        if paths is None:
            continue  # exited since it was found
        for controller, kind in kinds.items():
            if kind in paths:
                members.setdefault((controller, paths[kind]), {}).setdefault(p.pid, set()).add(p.tier)
    out = []
    for (controller, path), pids in sorted(members.items()):
        version = layout.versions[controller]
        assert version is not None
        directory = cgroup_dir(fs, version, controller, path)
        if directory is None:
            continue
        tiers = tuple(sorted(set().union(*pids.values())))
        inside = cgroup_procs(fs, directory) or []
        others = len(set(inside) - set(pids))
        state, why = OK, ""
        if len(tiers) > 1:
            state, why = CONFLICT, f"serving processes of tiers {', '.join(tiers)} in one cgroup"
        elif own_pid in inside or is_shared(path):
            state, why = SHARED, ("the agent's own cgroup" if own_pid in inside
                                  else "the root cgroup" if not path.strip("/") else "a slice or login session")
        elif version == V2 and controller not in (fs.try_read(f"{directory}/cgroup.controllers") or "").split():
            # Enabling it (the parent's cgroup.subtree_control) would change how every sibling shares the resource,
            # and the kernel refuses it where the parent holds processes: the host's to decide, not ours.
            state, why = UNAVAILABLE, (f"the {controller} controller is not enabled for this cgroup (its parent's "
                                       "cgroup.subtree_control): left, not enabled by the agent")
        elif "kubepods" in path and kubelet_report:
            state, why = KUBELET, "the kubelet owns pod cgroups (resources.kubelet_cgroups: report)"
        out.append(Group(controller, version, path, directory, tiers, tuple(sorted(pids)), state, why, others))
    return out
