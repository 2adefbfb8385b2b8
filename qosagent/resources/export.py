"""What resources shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client.core import Metric

from qosagent.exposition import Family, Series, families
from qosagent.resources.model import ResourcesPart

GROUP = ("controller", "cgroup", "tier")


def _number(value: str) -> float | None:
    try:
        return float(value.split()[0])
    except (IndexError, ValueError):
        return None


def _info(v: ResourcesPart) -> Series:
    for r in v.groups:
        g = r.group
        yield [g.controller, g.path, g.tier or "+".join(g.tiers), g.version, g.state, str(r.applied).lower(),
               r.error], 1.0


def _files(v: ResourcesPart) -> Series:
    for r in v.groups:
        for f, value in sorted(r.set.items()):
            n = _number(value)
            if n is not None:
                yield [r.group.controller, r.group.path, r.group.tier, f], n


def _throttle(key: str, scale: float = 1.0) -> Callable[[ResourcesPart], Series]:
    def series(v: ResourcesPart) -> Series:
        return (([r.group.controller, r.group.path, r.group.tier], r.throttled[key] * scale)
                for r in v.groups if key in r.throttled)
    return series


def _memory_events(v: ResourcesPart) -> Series:
    for r in v.groups:
        for event, n in sorted(r.memory_events.items()):
            yield [r.group.controller, r.group.path, r.group.tier, event], n


def _tiers(get: Callable[[Any], Any]) -> Callable[[ResourcesPart], Series]:
    def series(v: ResourcesPart) -> Series:
        return (([t.tier], get(t)) for t in v.tiers if get(t) is not None)
    return series


def _counter(kind: str) -> Callable[[ResourcesPart], Series]:
    def series(v: ResourcesPart) -> Series:
        return (([k], n) for k, n in sorted(v.counters.get(kind, {}).items()))
    return series


FAMILIES: tuple[Family[ResourcesPart], ...] = (
    Family("qosagent_resources_group_info", "gauge", "1 per serving process group (a cgroup, per controller): its "
           "tier, cgroup version, state (ok, shared, conflict, kubelet, backed_off, moved, unavailable), whether what "
           "was decided is written, and the kernel's refusal if not", (*GROUP, "version", "state", "applied", "error"),
           _info),
    Family("qosagent_resources_setting", "gauge", "The value set (or that would be, in dry-run) in a group's "
           "controller file", (*GROUP, "file"), _files),
    Family("qosagent_resources_throttled_periods", "counter", "CFS periods in which the group was throttled "
           "(cpu.stat nr_throttled)", GROUP, _throttle("nr_throttled")),
    Family("qosagent_resources_throttled_seconds", "counter", "Time the group was throttled (cpu.stat "
           "throttled_usec; v1 throttled_time)", GROUP, _throttle("throttled_usec", 1e-6)),
    Family("qosagent_resources_memory_events", "counter", "Memory events of the group (v2 memory.events: low, high, "
           "max, oom, oom_kill; v1: failcnt, oom_kill)", (*GROUP, "event"), _memory_events),
    Family("qosagent_resources_quota_cpus", "gauge", "The CPUs the suppression loop leaves the tier (absent: as "
           "configured)", ("tier",), _tiers(lambda t: t.quota_cpus)),
    Family("qosagent_resources_suppression_steps", "gauge", "Suppression steps in force on the tier", ("tier",),
           _tiers(lambda t: t.step)),
    Family("qosagent_resources_usage_cpus", "gauge", "CPUs the tier's serving processes used over the last "
           "reconcile", ("tier",), _tiers(lambda t: t.usage_cpus)),
    Family("qosagent_resources_hinted_threads", "gauge", "Serving threads of the tier holding its scheduler hint",
           ("tier",), _tiers(lambda t: t.threads)),
    Family("qosagent_resources_actions", "counter", "Resources decisions by action", ("action",),
           _counter("actions")),
    Family("qosagent_resources_errors", "counter", "Writes the kernel refused (by errno name), and originals that "
           "could not be saved (state_dir)", ("kind",), _counter("errors")),
    Family("qosagent_resources_rewritten", "counter", "Groups another owner rewrote (the kubelet, systemd), left to "
           "it from then on", ("controller",), _counter("rewritten")),
)


def metrics(view: ResourcesPart) -> Iterable[Metric]:
    return families(FAMILIES, view)


def status(view: ResourcesPart) -> dict[str, Any]:
    return {
        "mode": view.mode,
        "enforcing": view.enforcing,
        "slice_supported": view.slice_supported,
        "pressed": view.pressed,
        "cpu_held": sorted(view.cpu_held),
        "groups": [{"controller": r.group.controller, "cgroup": r.group.path, "version": r.group.version,
                    "tiers": list(r.group.tiers), "pids": list(r.group.pids), "state": r.group.state,
                    "why": r.group.why, "set": dict(r.set), "applied": r.applied, "error": r.error,
                    "throttled": dict(r.throttled), "memory_events": dict(r.memory_events)} for r in view.groups],
        "tiers": [{"tier": t.tier, "groups": t.groups, "quota_cpus": t.quota_cpus, "configured_cpus": t.configured_cpus,
                   "step": t.step, "hint": t.hint, "threads": t.threads, "usage_cpus": t.usage_cpus}
                  for t in view.tiers],
        "counters": {k: dict(v) for k, v in view.counters.items()},
    }


# What the kernel reports back of a memory group, in the status column KERNEL: the throttle, the hard limit's hits
# (memory_max) and the kills (v2 memory.events), or the hard limit's hits and the kills (v1).
MEMORY_SHOWN = ("high", "max", "oom", "oom_kill", "failcnt")


def _kernel(g: dict[str, Any]) -> str:
    """A cpu group's throttled periods and time (cpu.stat), a memory group's events."""
    t = g["throttled"]
    if "nr_throttled" in t:
        return f"thr {t['nr_throttled']} {t.get('throttled_usec', 0) / 1e6:.1f}s"
    ev = g["memory_events"]
    return " ".join(f"{k} {ev[k]}" for k in MEMORY_SHOWN if k in ev) or "-"


def render(status: dict[str, Any]) -> str:
    slices = "custom slices" if status.get("slice_supported") else "nice"
    pressed = f"; {status['pressed']} near its SLO" if status.get("pressed") else ""
    lines = [f"RESOURCES ({status.get('mode')}; hints by {slices}{pressed})",
             "TIER       GROUPS  CPUS      IN_FORCE  STEP  USED   HINT          THREADS"]
    for t in status.get("tiers", []):
        cpus = "-" if t["configured_cpus"] is None else f"{t['configured_cpus']:g}"
        force = "-" if t["quota_cpus"] is None else f"{t['quota_cpus']:g}"
        used = "-" if t["usage_cpus"] is None else f"{t['usage_cpus']:.2f}"
        lines.append(f"{t['tier'][:10]:<10} {t['groups']:<7} {cpus:<9} {force:<9} {t['step']:<5} {used:<6} "
                     f"{t['hint'] or '-':<13} {t['threads']}")
    lines.append(f"{'CGROUP':<40} CTRL    VER  TIER      STATE       {'KERNEL':<24} SET")
    for g in status.get("groups", []):
        tier = "+".join(g["tiers"])
        done = "" if g["applied"] or not g["set"] else "*"
        shown = ", ".join(f"{f}={v}" for f, v in g["set"].items()) or (g["why"] or "-")
        lines.append(f"{g['cgroup'][-40:]:<40} {g['controller']:<7} {g['version']:<4} {tier[:9]:<9} "
                     f"{g['state']:<11} {_kernel(g):<24} {shown}{done}" + (f"  error: {g['error']}" if g["error"]
                                                                            else ""))
    if not status.get("groups"):
        lines.append("(no serving process of a tier with resources: found)")
    if any(g["set"] and not g["applied"] and not g["error"] for g in status.get("groups", [])):
        lines.append("* dry-run: computed, not written")
    return "\n".join(lines)
