"""The loop, pure: CPU taken from lower tiers while a higher one nears its SLO, and given back when calm returns.

No I/O and no clock: time comes in as `now`. The signal is the tick's one SLO verdict (qosagent/slo.py), the one
admission judges: a tier is pressed at or above admission.near_slo x its SLO. While one is, the tiers below it
(lower weight) lose CPU, the lowest first, one step per `every`: each step keeps `factor` of the quota in force, or
of what the tier used where that is less (a quota far above use would take many steps to bite), never below
`floor_cpus`. The next tier up loses CPU only once the one below is at its floor. When every tier has been healthy
for `healthy_ticks` ticks, every tier cut gets `release_step` more per `release_every`, until its configured `cpus`
(or the node's) is back, which ends its suppression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from qosagent.resources.config import SuppressConfig
from qosagent.slo import TierSlo

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
