"""The closed loop's pure decision: tick inputs + policy + previous state -> new state, limit changes, reasons.

No I/O and no clock: time comes in as `TickInput.now`, so tests drive it with synthetic traces and a fake clock.

Two reasons change a limit:
- latency: a tier whose quantile stays above its SLO for `breach_ticks` ticks is in breach; each cut takes the
  lowest-weight tier that still has headroom above its floor, never one above the most important breaching tier,
  so the cut moves up the tiers only while the breach persists and the tiers below are at their floors; recovery
  +raise_step per `healthy_ticks` healthy ticks, after `cooldown` since the tenant's last cut.
- GPU memory: above `enter` on a serving GPU, new requests of the lowest tier are refused (limit 0, or the tier's
  floor when it has one), one more tier per `escalate_after`, until every serving GPU is below `exit`. An unknown
  GPU state never sheds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from qosagent.admission.config import AdmissionConfig
from qosagent.admission.model import AdmissionPart
from qosagent.tenants import TenantLimit

# Decision actions and reasons: the values of the metric labels `action` and `reason` (see docs/admission.md).
CUT, RAISE, RESTORE, SHED, UNSHED = "cut", "raise", "restore", "shed", "unshed"
SLO_BREACH = "slo_breach"
SLO_RECOVERED = "slo_recovered"
GPU_PRESSURE = "gpu_memory_pressure"
GPU_RELIEVED = "gpu_memory_relieved"
GPU_UNKNOWN = "gpu_state_unknown"


@dataclass(frozen=True)
class TierInput:
    name: str
    weight: int
    slo: float  # seconds
    observed: float | None  # the policy's quantile over the latency window, seconds; None: no requests


@dataclass(frozen=True)
class TenantInput:
    name: str
    tier: str
    baseline: TenantLimit | None  # None: unlimited
    floor_rps: float = 0.0
    floor_burst: int = 0
    admitted_rps: float | None = None  # None: not measured
    dropped_rps: float | None = None
    in_flight: int | None = None


@dataclass(frozen=True)
class GpuInput:
    known: bool
    ratio: float | None = None  # highest memory used ratio over the serving GPUs that answered
    gpu: int | None = None  # the GPU with that ratio
    reason: str = ""  # why unknown

    @staticmethod
    def unknown(reason: str) -> "GpuInput":
        return GpuInput(False, reason=reason)


@dataclass(frozen=True)
class TickInput:
    now: float
    tiers: Mapping[str, TierInput]
    tenants: Mapping[str, TenantInput]
    gpu: GpuInput
    runqueue_p99: float | None = None
    # The latency window: a quantile reflects a cut only once the window has turned over since it.
    window_s: float = 0.0


@dataclass(frozen=True)
class TenantState:
    limit: TenantLimit | None = None  # the adaptive limit; None: baseline in force
    origin_rps: float | None = None  # where the first cut started: recovery up to here restores the baseline
    last_cut: float = -math.inf
    shed: bool = False


@dataclass(frozen=True)
class LoopState:
    tenants: Mapping[str, TenantState] = field(default_factory=dict)
    breach_streak: Mapping[str, int] = field(default_factory=dict)  # per tier
    healthy_streak: int = 0
    escalation: int = 0  # cuts taken in the current breach episode
    ticks_since_cut: int = 1 << 30
    last_cut: float = -math.inf
    last_change: float = -math.inf  # the last cut or raise
    gpu_pressure: bool = False
    shed_tiers: int = 0  # how many of the lowest tiers are shed
    last_shed: float = -math.inf


@dataclass(frozen=True)
class Change:
    tenant: str
    action: str
    old: TenantLimit | None  # in force before (None: unlimited)
    new: TenantLimit | None
    reason: str
    inputs: Mapping[str, Any]


@dataclass(frozen=True)
class TierView:
    observed: float | None
    slo: float
    breach_streak: int
    in_breach: bool
    near_slo: bool


@dataclass(frozen=True)
class Outcome:
    state: LoopState
    changes: tuple[Change, ...]
    overrides: Mapping[str, TenantLimit]  # what the kernel should enforce instead of the baseline
    part: AdmissionPart
    tiers: Mapping[str, TierView]
    gpu: GpuInput
    run_pre_cleanup: bool = False


def shed_limit(t: TenantInput) -> TenantLimit:
    """A shed tenant's limit: no new requests, except what its tier's floor guarantees (the floor is a contract
    the quota writer also holds the kernel to; a tier without a floor is shed completely)."""
    return TenantLimit(t.floor_rps, max(1, t.floor_burst) if t.floor_rps > 0 else 0)


def effective(t: TenantInput, s: TenantState) -> TenantLimit | None:
    """The limit in force for a tenant: shed, else the adaptive limit, else its baseline."""
    if s.shed:
        return shed_limit(t)
    return s.limit if s.limit is not None else t.baseline


def _tier_order(tiers: Mapping[str, TierInput]) -> list[str]:
    """Least important first; equal weights in name order so the order never depends on config order."""
    return sorted(tiers, key=lambda n: (tiers[n].weight, n))


def _rate(rps: float) -> float:
    """Rates in hundredths, rounded down: readable in the audit, and never a hair over the cut or the step."""
    return math.floor(rps * 100) / 100


def _scaled_burst(ref: TenantLimit | None, rps: float, floor_burst: int) -> int:
    # Keep the reference's burst-to-rate ratio; without one, a tenth of a second's worth of requests.
    if ref is not None and ref.rps > 0:
        burst = round(ref.burst * rps / ref.rps)
    else:
        burst = math.ceil(rps * 0.1)
    return max(1, floor_burst, burst)


def _cut_one(t: TenantInput, s: TenantState, factor: float, policy: AdmissionConfig) -> TenantLimit | None:
    """The tenant's limit after one cut, or None when it has no headroom above its floor."""
    cur = effective(t, s)
    base = cur.rps if cur is not None else None
    # Cut from what actually flows: a limit far above the admitted rate would take many cuts to bite.
    if t.admitted_rps is not None and t.admitted_rps > 0:
        base = t.admitted_rps if base is None else min(base, t.admitted_rps)
    if base is None:
        return None  # unlimited and nothing measured: no basis for a rate
    floor = max(t.floor_rps, policy.min_rps)
    rps = max(floor, _rate(base * factor))
    if cur is not None and rps >= cur.rps:
        return None
    return TenantLimit(rps, _scaled_burst(cur, rps, t.floor_burst))


def decide(inp: TickInput, policy: AdmissionConfig, prev: LoopState) -> Outcome:
    now = inp.now
    order = _tier_order(inp.tiers)
    states = {name: prev.tenants.get(name, TenantState()) for name in inp.tenants}
    changes: list[Change] = []

    # ---- per-tier latency evaluation ----
    views: dict[str, TierView] = {}
    streak: dict[str, int] = {}
    all_healthy = True
    for name in order:
        tier = inp.tiers[name]
        obs = tier.observed
        over = obs is not None and obs > tier.slo
        streak[name] = prev.breach_streak.get(name, 0) + 1 if over else 0
        if obs is not None and obs > tier.slo * policy.healthy_below:
            all_healthy = False
        views[name] = TierView(obs, tier.slo, streak[name], streak[name] >= policy.breach_ticks,
                               obs is not None and obs >= tier.slo * policy.near_slo)
    breaching = [n for n in order if views[n].in_breach]

    def note(tenant: str, extra: Mapping[str, Any]) -> dict[str, Any]:
        t = inp.tenants[tenant]
        out: dict[str, Any] = {"tier": t.tier, "admitted_rps": t.admitted_rps, "dropped_rps": t.dropped_rps,
                               "in_flight": t.in_flight}
        if inp.runqueue_p99 is not None:
            out["runqueue_p99_s"] = inp.runqueue_p99
        out.update(extra)
        return out

    # ---- latency: cut while a tier is in breach ----
    escalation = prev.escalation
    healthy_streak = prev.healthy_streak
    since_cut = prev.ticks_since_cut + 1
    if breaching:
        healthy_streak = 0
    elif all_healthy:
        healthy_streak += 1
    else:
        healthy_streak = 0
    last_cut, last_change = prev.last_cut, prev.last_change
    # After a cut, the next one waits breach_ticks ticks and a whole latency window, so each cut is seen working
    # (or not) before another: cutting on a window that still holds pre-cut requests overshoots.
    if breaching and since_cut >= policy.breach_ticks and now - last_cut >= inp.window_s:
        driver = breaching[-1]  # the most important tier in breach decides how far up the cut may go
        d = inp.tiers[driver]
        factor = policy.cut_factor
        if policy.cut == "gradient":
            factor = min(1.0, max(0.5, d.slo / d.observed)) if d.observed else 1.0
        eligible = [n for n in order if inp.tiers[n].weight <= d.weight]
        cuts: dict[str, TenantLimit] = {}
        for tier_name in eligible:
            for name, t in inp.tenants.items():
                if t.tier == tier_name and not states[name].shed:
                    new = _cut_one(t, states[name], factor, policy)
                    if new is not None:
                        cuts[name] = new
        # The lowest tier with headroom takes the whole cut; the next tier up waits until this one is at its floor.
        lowest = next((n for n in eligible if any(inp.tenants[c].tier == n for c in cuts)), None)
        cause = {"breach_tier": driver, "observed_s": d.observed, "slo_s": d.slo, "quantile": policy.quantile,
                 "factor": round(factor, 4), "escalation": escalation}
        acted = False
        for name, new in cuts.items():
            t = inp.tenants[name]
            if t.tier != lowest:
                continue
            s = states[name]
            cur = effective(t, s)
            origin = s.origin_rps if s.origin_rps is not None else (cur.rps if cur is not None else t.admitted_rps)
            states[name] = replace(s, limit=new, origin_rps=origin, last_cut=now)
            last_change = now
            changes.append(Change(name, CUT, cur, new, SLO_BREACH, note(name, cause)))
            acted = True
        if acted:
            escalation += 1
            since_cut = 0
            last_cut = now

    # ---- latency: recovery after healthy_ticks, paced and after the cooldown ----
    # A raise, like a cut, waits until the window no longer holds requests from before the last change.
    if not breaching and healthy_streak >= policy.healthy_ticks and now - last_change >= inp.window_s:
        escalation = 0
        raised = False
        for name, t in inp.tenants.items():
            s = states[name]
            if s.limit is None or s.shed or now - s.last_cut < policy.cooldown:
                continue
            # A limit the tenant does not press against tells nothing about whether more would hurt.
            if t.admitted_rps is None or t.admitted_rps < 0.5 * s.limit.rps:
                continue
            rps = _rate(s.limit.rps * (1.0 + policy.raise_step))
            target = t.baseline.rps if t.baseline is not None else s.origin_rps
            why = {"healthy_ticks": healthy_streak, "step": policy.raise_step}
            if target is None or rps >= target:
                states[name] = TenantState(last_cut=s.last_cut)
                changes.append(Change(name, RESTORE, s.limit, t.baseline, SLO_RECOVERED, note(name, why)))
            else:
                new = TenantLimit(rps, _scaled_burst(s.limit, rps, t.floor_burst))
                states[name] = replace(s, limit=new)
                changes.append(Change(name, RAISE, s.limit, new, SLO_RECOVERED, note(name, why)))
            raised = True
        if raised:
            healthy_streak = 0
            last_change = now

    # ---- GPU memory pressure: shed tier by tier, with hysteresis ----
    g = inp.gpu
    pressure, shed_tiers, last_shed = prev.gpu_pressure, prev.shed_tiers, prev.last_shed
    run_pre_cleanup = False
    release_reason = GPU_RELIEVED
    if not g.known or g.ratio is None:
        if pressure:
            release_reason = GPU_UNKNOWN
        pressure, shed_tiers = False, 0
    elif not pressure and g.ratio > policy.gpu_pressure.enter:
        pressure, shed_tiers, last_shed, run_pre_cleanup = True, 1, now, True
    elif pressure and g.ratio < policy.gpu_pressure.exit:
        pressure, shed_tiers = False, 0
    elif (pressure and g.ratio > policy.gpu_pressure.enter and shed_tiers < len(order)
          and now - last_shed >= policy.gpu_pressure.escalate_after):
        shed_tiers, last_shed = shed_tiers + 1, now
    shed_set = set(order[:shed_tiers])
    gpu_note = {"gpu": g.gpu, "memory_used_ratio": g.ratio, "enter": policy.gpu_pressure.enter,
                "exit": policy.gpu_pressure.exit, "shed_tiers": sorted(shed_set)}
    if not g.known:
        gpu_note["gpu_unknown"] = g.reason
    for name, t in inp.tenants.items():
        s = states[name]
        want = t.tier in shed_set
        if want == s.shed:
            continue
        before = effective(t, s)
        states[name] = replace(s, shed=want)
        after = effective(t, states[name])
        if want:
            changes.append(Change(name, SHED, before, after, GPU_PRESSURE, note(name, gpu_note)))
        else:
            changes.append(Change(name, UNSHED, before, after, release_reason, note(name, gpu_note)))

    overrides = {}
    for name, t in inp.tenants.items():
        s = states[name]
        if s.shed:
            overrides[name] = shed_limit(t)
        elif s.limit is not None:
            overrides[name] = s.limit
    state = LoopState(
        tenants=MappingProxyType(states),
        breach_streak=MappingProxyType(streak),
        healthy_streak=healthy_streak,
        escalation=escalation,
        ticks_since_cut=since_cut,
        last_cut=last_cut,
        last_change=last_change,
        gpu_pressure=pressure,
        shed_tiers=shed_tiers,
        last_shed=last_shed,
    )
    part = AdmissionPart(
        near_slo=frozenset(n for n, v in views.items() if v.near_slo),
        in_breach=frozenset(breaching),
        gpu_pressure=pressure,
    )
    return Outcome(state, tuple(changes), MappingProxyType(overrides), part, MappingProxyType(views), g,
                   run_pre_cleanup)
