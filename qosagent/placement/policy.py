"""Placement's decisions, pure: from the tick's part (the processes found), their targets (planner.plan) and what
placement last did (the records), the step each process needs, each a Decision whose command the applier carries
out."""

from __future__ import annotations

from typing import Any, Collection, Mapping

from qosagent.cpulist import format_cpulist
from qosagent.placement.discovery import ProcInfo
from qosagent.placement.model import PLACEMENT, Drop, PlacementPart, Place, Record
from qosagent.placement.planner import Target
from qosagent.snapshot import Decision


def decide(view: PlacementPart, targets: Mapping[int, Target], records: Mapping[int, Record],
           stored: Collection[int], enforce: bool) -> list[Decision]:
    """The tick's decisions: forget the records of processes gone (or of a pid reused), release those no selector
    names now, then for each process found the step towards its target (pin, correct a drift, restore, leave), or
    none where it is there. stored: the pids whose original affinity is saved; enforce: whether pins are written."""
    procs = {p.pid: p for p in view.procs}
    out: list[Decision] = []
    # Forgetting comes first: a pid reused by a new process must lose the old one's record and originals
    # before the new one is pinned and its own originals are saved.
    for pid, rec in sorted(records.items()):
        p = procs.get(pid)
        if pid in view.gone or (p is not None and p.start != rec.start):
            out.append(_decision(pid, rec.name, "forget", rec.cpus, None, "exited", rec.gpus, enforce,
                                 applied=True, command=Drop(pid, release=False)))
        elif p is None:
            # Still running but no selector names it now (a reload): it gets its original affinity back.
            out.append(_decision(pid, rec.name, "release", rec.cpus, None, "no longer selected", rec.gpus, enforce,
                                 applied=pid in stored, command=Drop(pid, release=True)))
    for p in view.procs:
        d = _compare(p, targets[p.pid], records.get(p.pid), stored, enforce)
        if d is not None:
            out.append(d)
    return out


def _decision(pid: int, name: str, action: str, old: frozenset[int] | None, new: frozenset[int] | None,
              reason: str, gpus: tuple[int, ...], enforce: bool, command: Place | Drop, applied: bool | None = None,
              **inputs: Any) -> Decision:
    return Decision(
        capability=PLACEMENT.name, target=f"pid {pid} ({name})", action=action,
        old=format_cpulist(old) if old is not None else None,
        new=format_cpulist(new) if new is not None else None, reason=reason,
        inputs={"pid": pid, "gpus": list(gpus), **inputs},
        applied=enforce if applied is None else applied, command=command,
    )


def _compare(p: ProcInfo, t: Target, rec: Record | None, stored: Collection[int], enforce: bool) -> Decision | None:
    if rec is not None and rec.start != p.start:
        rec = None  # the pid names another program now; "forget" covers the old one
    threads = p.thread_cpus or {}
    current = threads.get(p.pid) or (next(iter(threads.values())) if threads else None)
    inputs = {"node": t.node, "selector": p.selector,
              "cpuset": format_cpulist(p.cpuset) if p.cpuset is not None else None}
    if t.pinned:
        if rec is None or rec.cpus != t.cpus or rec.node != t.node or (enforce and not rec.applied):
            return _decision(p.pid, p.name, "pin", current, t.cpus, t.reason, t.gpus, enforce,
                             Place("pin", p, t, t.reason), **inputs)
        # A thread the application bound inside the target (one CPU of it, say) is placed, not drifted.
        off = {tid: c for tid, c in threads.items() if not c <= t.cpus}
        if enforce and off:
            tid, c = sorted(off.items())[0]
            why = f"drift: {len(off)} of {len(threads)} threads off target (tid {tid} on {format_cpulist(c)})"
            return _decision(p.pid, p.name, "correct", c, t.cpus, why, t.gpus, enforce, Place("correct", p, t, why),
                             **inputs)
        return None
    if rec is not None and rec.cpus is not None and p.pid in stored:
        return _decision(p.pid, p.name, "restore", current, None, t.reason, t.gpus, enforce,
                         Place("restore", p, t, t.reason), **inputs)
    if rec is None or rec.reason != t.reason or rec.cpus is not None:
        # Nothing is written; the decision is there so the audit says why this process was left alone.
        return _decision(p.pid, p.name, "leave", current, current, t.reason, t.gpus, enforce,
                         Place("leave", p, t, t.reason), applied=True, **inputs)
    return None
