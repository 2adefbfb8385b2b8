"""What placement shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qosagent.cpulist import format_cpulist
from qosagent.placement.model import PlacementPart

if TYPE_CHECKING:
    from prometheus_client.core import Metric


def metrics(view: PlacementPart) -> Iterable["Metric"]:
    info = GaugeMetricFamily(
        "qosagent_placement_process_info", "1 per placed or considered process: its node, CPUs, GPUs, last action "
        "and why", labels=["pid", "name", "node", "cpus", "gpus", "action", "applied", "reason"])
    local = GaugeMetricFamily("qosagent_placement_memory_local_ratio",
                              "Share of the process's resident pages on its target node (numa_maps)",
                              labels=["pid", "name", "node"])
    pages = GaugeMetricFamily("qosagent_placement_memory_pages", "Resident pages of the process per NUMA node",
                              labels=["pid", "name", "node"])
    for r in view.records:
        pid = str(r["pid"])
        node = "" if r["node"] is None else str(r["node"])
        info.add_metric([pid, r["name"], node, r["cpus"] or "", ",".join(map(str, r["gpus"])), r["last_action"],
                         str(r["applied"]).lower(), r["reason"]], 1.0)
        if r["memory_local"] is not None:
            local.add_metric([pid, r["name"], node], r["memory_local"])
        for n, count in r["pages"].items():
            pages.add_metric([pid, r["name"], n], count)
    yield info
    yield local
    yield pages
    yield GaugeMetricFamily("qosagent_placement_processes", "Selected processes placement tracks",
                            value=len(view.records))
    c = view.counters
    actions = CounterMetricFamily("qosagent_placement_actions", "Placement decisions by action", labels=["action"])
    for k, v in sorted(c.get("actions", {}).items()):
        actions.add_metric([k], v)
    yield actions
    mig = CounterMetricFamily("qosagent_placement_migrations", "migrate_pages runs by result (noop: nothing to "
                              "move, e.g. one memory node)", labels=["result"])
    for k in ("moved", "noop", "failed"):
        mig.add_metric([k], c.get("migrations", {}).get(k, 0))
    yield mig
    moved = CounterMetricFamily("qosagent_placement_pages_migrated", "Pages moved to their target node "
                                "(moved) and pages the kernel could not move (not_moved)", labels=["result"])
    for k in ("moved", "not_moved"):
        moved.add_metric([k], c.get("pages_migrated", {}).get(k, 0))
    yield moved
    drift = CounterMetricFamily("qosagent_placement_drift", "Threads found off their target CPUs",
                                labels=["result"])
    for k, v in sorted(c.get("drift", {}).items()):
        drift.add_metric([k], v)
    yield drift
    errs = CounterMetricFamily("qosagent_placement_errors", "Placement writes that failed, by kind "
                               "(exited: the process left mid-placement)", labels=["kind"])
    for k, v in sorted(c.get("errors", {}).items()):
        errs.add_metric([k], v)
    yield errs

def status(view: PlacementPart) -> dict[str, Any]:
    return {
        "mode": view.mode,
        "nodes": {str(n.id): format_cpulist(n.cpus) for n in view.topology.nodes.values()},
        "reserved_cpus": view.reserved_cpus,
        "processes": list(view.records),
        "counters": view.counters,
        "warnings": list(view.topology.warnings),
    }

def render(status: dict[str, Any]) -> str:
    lines = [f"PLACEMENT ({status.get('mode')}; nodes "
             + ", ".join(f"{n}: {c or '-'}" for n, c in status.get("nodes", {}).items())
             + f"; reserved {status.get('reserved_cpus') or '-'})"]
    lines.append("PID      NAME             NODE  CPUS         GPUS     MEM_LOCAL  ACTION    REASON")
    for r in status.get("processes", []):
        local = "-" if r.get("memory_local") is None else f"{r['memory_local'] * 100:.0f}%"
        action = r["last_action"] + ("" if r["applied"] or r["last_action"] in ("leave", "error") else "*")
        lines.append(f"{r['pid']:<8} {r['name'][:16]:<16} {'-' if r['node'] is None else r['node']:<5} "
                     f"{r['cpus'] or '-':<12} {','.join(map(str, r['gpus'])) or '-':<8} {local:<10} "
                     f"{action:<9} {r['reason']}")
    if not status.get("processes"):
        lines.append("(no selected process running)")
    if any(not r["applied"] and r["last_action"] in ("pin", "correct") for r in status.get("processes", [])):
        lines.append("* dry-run: computed, not written")
    for w in status.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)
