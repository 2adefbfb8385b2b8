"""What placement shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client.core import Metric

from qosagent.cpulist import format_cpulist
from qosagent.exposition import Family, Series, families, one
from qosagent.placement.model import PlacementPart

# A process is named by what survives its restart (its name, the selector that chose it, its GPUs), not by its
# pid: a server restarting would otherwise start new series each time. The pid is in the info family alone.
PROC = ("process", "node")


def _node(r: dict[str, Any]) -> str:
    return "" if r["node"] is None else str(r["node"])


def process_names(view: PlacementPart) -> dict[int, str]:
    """pid -> "name@selector" (+ "/gpu0,1" with GPUs; "#2", "#3" ... for the later of processes that would share
    one, in pid order)."""
    out: dict[int, str] = {}
    seen: dict[str, int] = {}
    for r in sorted(view.records, key=lambda r: r["pid"]):
        key = f"{r['name']}@{r['selector']}" + (f"/gpu{','.join(map(str, r['gpus']))}" if r["gpus"] else "")
        seen[key] = seen.get(key, 0) + 1
        out[r["pid"]] = key if seen[key] == 1 else f"{key}#{seen[key]}"
    return out


def _info(view: PlacementPart) -> Series:
    names = process_names(view)
    for r in view.records:
        yield [names[r["pid"]], str(r["pid"]), r["name"], _node(r), r["cpus"] or "", ",".join(map(str, r["gpus"])),
               r["last_action"], str(r["applied"]).lower(), r["reason"]], 1.0


def _local(view: PlacementPart) -> Series:
    names = process_names(view)
    return (([names[r["pid"]], _node(r)], r["memory_local"]) for r in view.records if r["memory_local"] is not None)


def _pages(view: PlacementPart) -> Series:
    names = process_names(view)
    return (([names[r["pid"]], n], count) for r in view.records for n, count in r["pages"].items())


def _counter(kind: str, keys: tuple[str, ...] = ()) -> Callable[[PlacementPart], Series]:
    """One of the counters by key: every key seen, sorted; or the keys given, in their order, 0 until seen."""
    def series(view: PlacementPart) -> Series:
        counts = view.counters.get(kind, {})
        return (([k], counts.get(k, 0)) for k in keys) if keys else (([k], v) for k, v in sorted(counts.items()))
    return series


FAMILIES: tuple[Family[PlacementPart], ...] = (
    Family("qosagent_placement_process_info", "gauge", "1 per placed or considered process: its node, CPUs, GPUs, "
           "last action and why (process: its stable name in the other placement families; pid: the one running now)",
           ("process", "pid", "name", "node", "cpus", "gpus", "action", "applied", "reason"), _info),
    Family("qosagent_placement_memory_local_ratio", "gauge", "Share of the process's resident pages on its target "
           "node (numa_maps)", PROC, _local),
    Family("qosagent_placement_memory_pages", "gauge", "Resident pages of the process per NUMA node", PROC, _pages),
    Family("qosagent_placement_processes", "gauge", "Selected processes placement tracks", (),
           one(lambda v: len(v.records))),
    Family("qosagent_placement_actions", "counter", "Placement decisions by action", ("action",), _counter("actions")),
    Family("qosagent_placement_migrations", "counter", "migrate_pages runs by result (noop: nothing to move, e.g. "
           "one memory node)", ("result",), _counter("migrations", ("moved", "noop", "failed"))),
    Family("qosagent_placement_pages_migrated", "counter", "Pages moved to their target node (moved) and pages the "
           "kernel could not move (not_moved)", ("result",), _counter("pages_migrated", ("moved", "not_moved"))),
    Family("qosagent_placement_drift", "counter", "Threads found off their target CPUs", ("result",),
           _counter("drift")),
    Family("qosagent_placement_errors", "counter", "Placement writes that failed, by kind (exited: the process left "
           "mid-placement)", ("kind",), _counter("errors")),
)


def metrics(view: PlacementPart) -> Iterable[Metric]:
    return families(FAMILIES, view)


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
