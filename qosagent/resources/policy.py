"""The loop, pure: CPU taken from lower tiers while a higher one nears its SLO, and given back when calm returns.

No I/O and no clock: time comes in as `now`. The signal is the tick's one SLO verdict (qosagent/slo.py), the one
admission judges: a tier is pressed at or above admission.near_slo x its SLO. While one is, the tiers below it
(lower weight) lose CPU, the lowest first, one step per `every`: each step keeps `factor` of the quota in force, or
of what the tier used where that is less (a quota far above use would take many steps to bite), never below
`floor_cpus`. The next tier up loses CPU only once the one below is at its floor. When every tier has been healthy
for `healthy_ticks` ticks, every tier cut gets `release_step` more per `release_every`, until its configured `cpus`
(or the node's) is back, which ends its suppression.

The reconcile's decisions live here too: each group's files (planner.values), a release for a group whose serving
processes left, a back-off where another owner rewrote our files, a move out of a shared cgroup, and each serving
process's scheduler hint. They read and keep resources' Memory; what the host holds comes in (Rules.has_idle).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from qosagent.resources import discovery, planner
from qosagent.resources.config import SuppressConfig
from qosagent.resources.model import (BACKED_OFF, CONFLICT, KUBELET, MOVED, OK, RESOURCES, SHARED, BackOff, Files,
                                      Group, Hint, Memory, Move, Release, ResourcesPart, Sched)
from qosagent.slo import TierSlo
from qosagent.snapshot import Decision

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.latency.model import LatencyPart

CUT, RAISE, RESTORE = "cut", "raise", "restore"
NEAR_SLO, CALM = "near_slo", "calm"


@dataclass(frozen=True)
class TierIn:
    name: str
    weight: int
    verdict: TierSlo
    configured: float | None  # tiers.<name>.resources.cpus; None: unlimited
    settable: bool  # it has groups the capability may set
    usage: float | None = None  # CPUs its groups used over the last reconcile; None: not measured


@dataclass(frozen=True)
class LoopState:
    quota: Mapping[str, float] = field(default_factory=dict)  # tier -> the CPUs the loop leaves it
    steps: Mapping[str, int] = field(default_factory=dict)  # tier -> cuts in force
    last_step: float = -math.inf
    healthy: int = 0  # ticks in a row with every tier healthy


@dataclass(frozen=True)
class Step:
    tier: str
    action: str  # CUT, RAISE, RESTORE
    old: float | None  # CPUs (None: as configured)
    new: float | None
    reason: str  # NEAR_SLO, CALM
    why: str
    inputs: Mapping[str, Any]


@dataclass(frozen=True)
class Outcome:
    state: LoopState
    steps: tuple[Step, ...]
    held: frozenset[str]  # tiers below the pressed one that can still lose CPU
    pressed: str  # the most important tier near its SLO ("" when none)


def _cpus(x: float) -> float:
    """CPUs in thousandths, rounded down: readable in the audit, never a hair over the step."""
    return math.floor(x * 1000) / 1000


def decide(tiers: Mapping[str, TierIn], cfg: SuppressConfig, node_cpus: float, now: float,
           prev: LoopState) -> Outcome:
    quota, steps = dict(prev.quota), dict(prev.steps)
    for gone in set(quota) - set(tiers):
        quota.pop(gone)
        steps.pop(gone, None)
    order = sorted(tiers.values(), key=lambda t: (t.weight, t.name))
    pressed = [t for t in order if t.verdict.near]
    healthy = prev.healthy + 1 if all(t.verdict.healthy for t in order) else 0
    out: list[Step] = []
    last = prev.last_step

    def in_force(t: TierIn) -> float:
        return quota.get(t.name, t.configured if t.configured is not None else node_cpus)

    held: frozenset[str] = frozenset()
    driver = pressed[-1] if pressed else None
    if driver is not None and cfg.enabled:
        below = [t for t in order if t.weight < driver.weight and t.settable]
        held = frozenset(t.name for t in below if in_force(t) > cfg.floor_cpus)
        if now - last >= cfg.every:
            for t in below:
                cur = in_force(t)
                base = min(cur, t.usage) if t.usage else cur
                new = max(cfg.floor_cpus, _cpus(base * cfg.factor))
                if new >= cur:
                    continue
                v = driver.verdict
                quota[t.name], steps[t.name] = new, steps.get(t.name, 0) + 1
                out.append(Step(t.name, CUT, prev.quota.get(t.name), new, NEAR_SLO,
                                f"{driver.name} {v.observed or 0:.3f}s near its SLO {v.slo:g}s",
                                {"pressed_tier": driver.name, "observed_s": v.observed, "slo_s": v.slo,
                                 "from_cpus": cur, "used_cpus": t.usage, "factor": cfg.factor,
                                 "floor_cpus": cfg.floor_cpus, "step": steps[t.name]}))
                last = now
                break
    elif quota and healthy >= cfg.healthy_ticks and now - last >= cfg.release_every:
        for t in reversed(order):
            if t.name not in quota:
                continue
            cur = quota[t.name]
            target = t.configured if t.configured is not None else node_cpus
            new = _cpus(cur * (1 + cfg.release_step))
            inputs = {"healthy_ticks": healthy, "step": cfg.release_step, "to_cpus": target}
            if new >= target:
                del quota[t.name]
                steps.pop(t.name, None)
                out.append(Step(t.name, RESTORE, cur, None, CALM, "every tier healthy: CPU back", inputs))
            else:
                quota[t.name] = new
                out.append(Step(t.name, RAISE, cur, new, CALM, f"every tier healthy: +{cfg.release_step:g}", inputs))
        last = now
    state = LoopState(MappingProxyType(quota), MappingProxyType(steps), last, healthy)
    return Outcome(state, tuple(out), held, driver.name if driver else "")


# ---- the reconcile's decisions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rules:
    """What the decisions go by: the config in force and what was probed."""

    config: "Config"
    enforce: bool
    slices: bool  # custom scheduler slices here (sched.SliceProbe.supported)
    has_idle: Callable[[str], bool]  # the group directory has a cpu.idle file (read by the caller)
    tier_slo: Mapping[str, float]  # slo.tier_slos of config, kept per config by the caller

    @property
    def cfg(self) -> Any:
        return self.config.resources


def decision(rules: Rules, target: str, action: str, old: Any, new: Any, reason: str, inputs: dict[str, Any],
             command: Any, applied: bool | None = None) -> Decision:
    return Decision(RESOURCES.name, target, action, old, new, reason, inputs,
                    applied=rules.enforce if applied is None else applied, command=command)


def settable(mem: Memory, g: Group) -> bool:
    return g.state in (OK, MOVED) and g.key not in mem.backed_off


def step(rules: Rules, lat: "LatencyPart", part: ResourcesPart, mem: Memory, node_cpus: float, now: float,
         prev: LoopState) -> Outcome:
    """The loop's step on this tick's SLO verdict, the one admission judges."""
    cfg = rules.config
    adm = cfg.admission
    verdict = lat.judged(adm.signal, adm.quantile, rules.tier_slo, adm.near_slo, adm.healthy_below)
    can_set = {g.tier for g in mem.groups.values() if settable(mem, g)}
    tiers = {name: TierIn(name, cfg.tiers[name].weight, v,
                          (cfg.tiers[name].resources.cpus if cfg.tiers[name].resources else None),
                          name in can_set and cfg.tiers[name].resources is not None,
                          part.usage.get(name))
             for name, v in verdict.tiers.items()}
    return decide(tiers, rules.cfg.suppress, node_cpus, now, prev)


def step_decisions(rules: Rules, outcome: Outcome) -> list[Decision]:
    return [decision(rules, f"tier {s.tier}", s.action, _shown_cpus(s.old), _shown_cpus(s.new), s.reason,
                     {"tier": s.tier, "why": s.why, **s.inputs}, None)
            for s in outcome.steps]


def reconcile(rules: Rules, mem: Memory, quota: Mapping[str, float], part: ResourcesPart) -> list[Decision]:
    """The groups found this reconcile against those before: releases, back-offs, moves, reports, then files."""
    out: list[Decision] = []
    now = {g.key: g for g in part.found}
    for key, g in sorted(mem.groups.items()):
        if key not in now and key in mem.decided:
            out.append(decision(rules, key, "release", _shown(mem.decided[key]), None,
                                "its serving processes left the cgroup", {"tier": g.tier}, Release(g)))
    for key, paths in sorted(part.rewritten.items()):
        if key not in mem.backed_off:
            g = now[key]
            out.append(decision(rules, key, "back_off", None, None, "rewritten by another owner: left to it",
                                {"tier": g.tier, "files": [os.path.basename(p) for p in paths]}, BackOff(g, paths)))
    mem.groups = now
    for key, g in sorted(now.items()):
        state = BACKED_OFF if key in mem.backed_off or key in part.rewritten else g.state
        if state in (SHARED, CONFLICT) and rules.cfg.move:
            if mem.states.get(key) != MOVED:
                by_tier = tuple((t, tuple(sorted({p.pid for p in part.serving if p.tier == t and p.pid in g.pids})))
                                for t in g.tiers)
                out.append(decision(rules, key, "move", g.path, ", ".join(discovery.own_cgroup(t) for t in g.tiers),
                                    g.why, {"tiers": list(g.tiers), "pids": list(g.pids)}, Move(g, by_tier)))
                mem.states[key] = MOVED
            continue
        if state != OK and not (state == KUBELET and rules.cfg.kubelet_cgroups == "enforce"):
            if mem.states.get(key) != state:
                out.append(decision(rules, key, "report", None, None, f"{state}: {g.why or 'left to its owner'}",
                                    {"tiers": list(g.tiers), "pids": list(g.pids)}, None, applied=True))
                mem.states[key] = state
            continue
        mem.states[key] = state
    mem.states = {k: v for k, v in mem.states.items() if k in now}
    out += files(rules, mem, quota, [g for g in now.values() if mem.states.get(g.key) in (OK, KUBELET)])
    return out


def files(rules: Rules, mem: Memory, quota: Mapping[str, float], groups: list[Group]) -> list[Decision]:
    """Each group's controller files, where they differ from what was decided before."""
    out = []
    for g in sorted(groups, key=lambda g: g.key):
        if not g.tier or g.key in mem.backed_off:
            continue
        tier = rules.config.tiers.get(g.tier)
        if tier is None:
            continue
        values = planner.values(g.controller, g.version, tier, quota.get(g.tier), rules.has_idle(g.directory))
        if values == mem.decided.get(g.key, ()):
            continue  # unchanged, or nothing to set and nothing set before
        cut = quota.get(g.tier)
        reason = (f"{g.tier}: suppressed to {cut:g} CPUs" if cut is not None and g.controller == "cpu"
                  else f"{g.tier}: tiers.{g.tier}.resources")
        out.append(decision(rules, g.key, "set" if values else "release", _shown(mem.decided.get(g.key)),
                            _shown(values), reason, {"tier": g.tier, "version": g.version, "pids": list(g.pids)},
                            Files(g, values) if values else Release(g)))
    return out


def hint_of(config: "Config", slices: bool, tier: str) -> Hint | None:
    """The scheduler hint a tier's serving threads get (None: left as they are)."""
    t = config.tiers.get(tier)
    if t is None or t.resources is None:
        return None
    if t.resources.sched != "normal":
        return Hint(t.resources.sched)
    if not t.latency_sensitive():
        return None
    if slices:
        return Hint("normal", slice_ns=round(config.resources.latency_slice * 1e9))
    return Hint("normal", nice=config.resources.latency_nice)


def hints(rules: Rules, mem: Memory, part: ResourcesPart) -> list[Decision]:
    out = []
    by_pid: dict[int, Any] = {}
    for p in part.serving:
        by_pid.setdefault(p.pid, p)
    for pid, p in sorted(by_pid.items()):
        hint = hint_of(rules.config, rules.slices, p.tier)
        tiers = {q.tier for q in part.serving if q.pid == pid}
        if hint is None or len(tiers) > 1 or mem.hinted.get(pid) == (p.tier, hint):
            continue
        out.append(decision(rules, f"pid {pid} ({p.name})", "hint", None, hint.shown(),
                            f"{p.tier}: " + ("latency-sensitive" if hint.policy == "normal"
                                             else f"sched {hint.policy}"),
                            {"tier": p.tier, "pid": pid}, Sched(p.tier, (pid,), hint)))
    for pid, (tier, hint) in sorted(mem.hinted.items()):
        if pid not in by_pid or hint_of(rules.config, rules.slices, by_pid[pid].tier) is None:
            out.append(decision(rules, f"pid {pid}", "unhint", hint.shown(), None, "no longer a serving process "
                                "with a hint", {"tier": tier, "pid": pid}, Sched(tier, (pid,), None)))
    return out


def _shown_cpus(v: float | None) -> str | None:
    return None if v is None else f"{v:g}"


def _shown(values: tuple[tuple[str, str], ...] | None) -> str | None:
    return None if not values else ", ".join(f"{f}={v}" for f, v in values)
