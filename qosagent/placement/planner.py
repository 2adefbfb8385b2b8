"""Where each selected process should run: a pure function of the process, its GPUs and the host topology.

The answer is CPUs plus a memory node, or "leave it" — always with the reason, because an operator asks "why is
this pinned there" more often than anything else. Kubelet's cpuset is a bound, never widened: the target is always
inside it, and when the GPU's node has no CPU in it the process stays where kubelet put it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from qosagent.cpulist import format_cpulist
from qosagent.placement.discovery import ProcInfo
from qosagent.placement.topology import Topology


@dataclass(frozen=True)
class Policy:
    reserved: frozenset[int] = frozenset()
    span_policy: Literal["majority", "unpinned"] = "majority"
    cpu_node: int | None = None
    exclusive_cpus: Mapping[str, int] | None = None  # tier -> CPUs
    tiers: Mapping[str, str] | None = None  # tenant -> tier


# (home node, why, CPUs NVML names when the node itself is unknown)
Home = tuple[int | None, str, frozenset[int] | None]


@dataclass(frozen=True)
class Target:
    pid: int
    cpus: frozenset[int] | None  # None: leave the process where it is
    node: int | None  # memory node; None: do not migrate
    reason: str
    gpus: tuple[int, ...] = ()
    exclusive: bool = False

    @property
    def pinned(self) -> bool:
        return self.cpus is not None


def _available(topo: Topology, node: int, policy: Policy, proc: ProcInfo) -> frozenset[int]:
    cpus = topo.nodes[node].cpus - policy.reserved
    return cpus & proc.cpuset if proc.cpuset is not None else cpus


def _gpu_node(proc: ProcInfo, gpus: tuple[int, ...], topo: Topology, policy: Policy) -> Home:
    nodes: list[int] = []
    unknown: list[str] = []
    for g in gpus:
        acc = topo.gpu(g)
        if acc is None or acc.node is None:
            # NVML's CPU affinity spanning nodes still names CPUs; with one unknown GPU that is all there is.
            if acc is not None and acc.nvml_cpus and len(gpus) == 1:
                return None, f"GPU {g} node unknown; NVML CPU affinity {format_cpulist(acc.nvml_cpus)}", acc.nvml_cpus
            unknown.append(str(g))
            continue
        nodes.append(acc.node)
    if unknown:
        return None, f"NUMA node of GPU {', '.join(unknown)} unknown (sysfs numa_node -1, no NVML affinity)", None
    counts = collections.Counter(nodes)
    if len(counts) == 1:
        return nodes[0], f"GPU {','.join(map(str, gpus))} on node {nodes[0]}", None
    spread = ", ".join(f"node {n}: {c}" for n, c in sorted(counts.items()))
    if policy.span_policy == "unpinned":
        return None, f"GPUs span nodes ({spread}); span_policy unpinned", None
    top = max(counts.values())
    best = sorted(n for n, c in counts.items() if c == top)
    if len(best) > 1:
        # No majority: the node with more usable CPUs, then the lower id, so the answer never flips between runs.
        best.sort(key=lambda n: (-len(_available(topo, n, policy, proc)) if n in topo.nodes else 0, n))
        return best[0], f"GPUs span nodes ({spread}), no majority; node {best[0]} has the most usable CPUs", None
    return best[0], f"GPUs span nodes ({spread}); majority on node {best[0]}", None


def _home(proc: ProcInfo, gpus: tuple[int, ...], topo: Topology, policy: Policy) -> Home:
    if gpus:
        return _gpu_node(proc, gpus, topo, policy)
    pref = proc.node_pref if proc.node_pref is not None else policy.cpu_node
    if pref is not None:
        return pref, f"no GPU; configured node {pref}", None
    cpu_nodes = [n for n in topo.nodes.values() if n.cpus]
    if not cpu_nodes:
        return None, "no node has CPUs", None
    best = sorted(cpu_nodes, key=lambda n: (-len(_available(topo, n.id, policy, proc)), n.id))[0]
    return best.id, f"no GPU; node {best.id} has the most usable CPUs", None


def plan(procs: Sequence[ProcInfo], gpus_of: Mapping[int, tuple[int, ...]], topo: Topology,
         policy: Policy) -> dict[int, Target]:
    """One Target per process. Exclusive CPUs (tier guarantees) are handed out first, in pid order, and then taken
    away from every other process on that node."""
    homes = {p.pid: _home(p, gpus_of.get(p.pid, ()), topo, policy) for p in procs}
    taken, exclusive = _exclusive(procs, homes, topo, policy)
    return {p.pid: _target(p, gpus_of.get(p.pid, ()), homes[p.pid], exclusive.get(p.pid, (frozenset(), "")),
                           taken, topo, policy) for p in procs}


def _exclusive(procs: Sequence[ProcInfo], homes: Mapping[int, Home], topo: Topology,
               policy: Policy) -> tuple[dict[int, set[int]], dict[int, tuple[frozenset[int], str]]]:
    """The exclusive CPUs each process's tier wants on its node, in pid order while they last: the CPUs given per
    node, and per pid what it got (none: it shares the node) and why."""
    taken: dict[int, set[int]] = collections.defaultdict(set)  # node -> CPUs given exclusively
    exclusive: dict[int, tuple[frozenset[int], str]] = {}
    for p in sorted(procs, key=lambda p: p.pid):
        node, _, _ = homes[p.pid]
        tier = (policy.tiers or {}).get(p.tenant or "")
        want = (policy.exclusive_cpus or {}).get(tier or "")
        if not want or node is None or node not in topo.nodes:
            continue
        free = sorted(_available(topo, node, policy, p) - taken[node])
        if len(free) < want:
            exclusive[p.pid] = (frozenset(), f"tier {tier} wants {want} exclusive CPUs on node {node}, "
                                             f"only {len(free)} free; shares the node")
            continue
        mine = frozenset(free[:want])
        taken[node] |= mine
        exclusive[p.pid] = (mine, f"tier {tier}: {want} exclusive CPUs")
    return taken, exclusive


def _target(p: ProcInfo, gpus: tuple[int, ...], home: Home, exclusive: tuple[frozenset[int], str],
            taken: Mapping[int, set[int]], topo: Topology, policy: Policy) -> Target:
    """One process's Target from its home node and what the exclusive CPUs left."""
    node, why, nvml_cpus = home
    if node is None and nvml_cpus is not None:
        cpus = nvml_cpus - policy.reserved
        if p.cpuset is not None:
            cpus &= p.cpuset
        if not cpus:
            return Target(p.pid, None, None, f"{why}; none of them usable, not pinned", gpus)
        return Target(p.pid, cpus, topo.node_of_cpus(cpus), why, gpus)
    if node is None:
        return Target(p.pid, None, None, f"{why}; not pinned", gpus)
    if node not in topo.nodes:
        return Target(p.pid, None, None, f"{why}, but node {node} is not on this host; not pinned", gpus)
    mine, ex_why = exclusive
    if mine:
        return Target(p.pid, mine, node, f"{why}; {ex_why}", gpus, exclusive=True)
    cpus = _available(topo, node, policy, p) - taken.get(node, set())
    if not cpus:
        if not topo.nodes[node].cpus:
            why += f"; node {node} has no CPUs (memory only), not pinned"
        elif p.cpuset is not None and not (topo.nodes[node].cpus & p.cpuset):
            why += f"; its cpuset {format_cpulist(p.cpuset)} (kubelet) has no CPU on node {node}, left as placed"
        else:
            why += f"; no CPU left on node {node} after reserved and exclusive CPUs, not pinned"
        return Target(p.pid, None, None, why, gpus)
    if ex_why:
        why += f"; {ex_why}"
    if p.cpuset is not None and cpus != (topo.nodes[node].cpus - policy.reserved - taken.get(node, set())):
        why += f"; within cpuset {format_cpulist(p.cpuset)}"
    mem = node if topo.nodes[node].has_memory or not topo.numa else None
    if mem is None:
        why += f"; node {node} has no memory, pages stay"
    return Target(p.pid, cpus, mem, why, gpus)
