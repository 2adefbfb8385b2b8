"""The closed loop's pure decision: tick inputs + policy + previous state -> new state, limit changes, reasons.

No I/O and no clock: time comes in as `TickInput.now`, so tests drive it with synthetic traces and a fake clock.

Two reasons change a limit:
- latency: a tier whose quantile stays above its SLO for `breach_ticks` ticks is in breach; each cut takes the
  lowest-weight tier that still has headroom above its floor, never one above the most important breaching tier,
  so the cut moves up the tiers only while the breach persists and the tiers below are at their floors; recovery
  +raise_step per `healthy_ticks` healthy ticks, after `cooldown` since the tenant's last cut.
- server pressure: a server whose KV cache is above `kv_enter` (until below `kv_exit`) or whose queue stays above
  `queue_enter` for `queue_ticks` ticks (until at most `queue_exit`) is pressed; while one is, the lowest tier with
  headroom among the tenants it serves is cut, once per `cut_every`; recovery as for latency.
- GPU memory, where it is evidence (a serving GPU that no server with a reading may use, whose memory grew past
  `enter` while watched, or is over it with `trigger: level`): new requests of the lowest sheddable tier are
  refused, one more sheddable tier per `escalate_after`, until every such GPU is below `exit`. A tier that is not
  sheddable is never touched by this path; an unknown or overridden GPU reading sheds nothing.
Floors: a cut stops at the tier's floor, or at `min_rps` where the tier has none; a shed goes to the floor, 0
without one. Each tenant's state says which signal and rule set its limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from qosagent.admission.config import AdmissionConfig
from qosagent.admission.model import AdmissionPart
from qosagent.slo import TierSlo
from qosagent.tenants import TenantLimit

# Decision actions and reasons: the values of the metric labels `action` and `reason` (see docs/admission.md).
CUT, RAISE, RESTORE, SHED, UNSHED = "cut", "raise", "restore", "shed", "unshed"
SLO_BREACH = "slo_breach"
SLO_RECOVERED = "slo_recovered"
GPU_PRESSURE = "gpu_memory_pressure"
GPU_RELIEVED = "gpu_memory_relieved"
GPU_UNKNOWN = "gpu_state_unknown"
GPU_NOT_EVIDENCE = "gpu_memory_not_evidence"
SERVER_PRESSURE = "server_pressure"
SERVER_RELIEVED = "server_relieved"

# The signals that set a tenant's limit: the values of status's `signal` and the metric label `cause`.
BY_CONFIG, BY_SLO, BY_SERVER, BY_GPU = "config", "slo", "server", "gpu_memory"

# What a serving GPU's memory reading is worth (docs/admission.md, "GPU memory: evidence first"): the values of the
# metric label `evidence`. SERVER: a server that may use the GPU reports its KV cache or queue, and that reading
# speaks for it; MISSING: a server or a pre-allocating process may use it but no reading says how loaded it is;
# MEMORY: nothing but memory speaks for it; UNKNOWN: no memory reading.
SERVER_EVIDENCE, MISSING_EVIDENCE, MEMORY_EVIDENCE, UNKNOWN_EVIDENCE = "server", "missing", "memory", "unknown"
# Why memory over `enter` was not acted on: one of the above, or no growth seen (trigger: growth).
NO_GROWTH = "no_growth"


@dataclass(frozen=True)
class TierInput:
    name: str
    weight: int
    verdict: TierSlo  # this tick's SLO verdict of the tier (qosagent/slo.py), as everything else shows it
    sheddable: bool = False  # the GPU-memory path may shed it; it never touches a tier that is not

    @property
    def slo(self) -> float:  # seconds
        return self.verdict.slo

    @property
    def observed(self) -> float | None:  # the policy's quantile over the latency window, seconds; None: no requests
        return self.verdict.observed


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
    sheddable: bool = False
    ports: frozenset[int] = frozenset()  # the ports the tenant is matched on; empty: it may reach any server


@dataclass(frozen=True)
class ServerInput:
    port: int
    kind: str
    known: bool
    kv_cache_usage: float | None = None  # None: unknown (not exported, NaN, ...): no pressure is read from it
    requests_waiting: float | None = None


@dataclass(frozen=True)
class GpuReading:
    """One serving GPU: its memory and what else speaks for its load."""

    index: int
    ratio: float | None  # memory used; None: no reading (why says)
    evidence: str  # SERVER_EVIDENCE, MISSING_EVIDENCE, MEMORY_EVIDENCE, UNKNOWN_EVIDENCE
    why: str = ""  # what the evidence is, as status shows it ("the server reports KV 30 % (port 8000)")
    kv: float | None = None  # SERVER_EVIDENCE: the highest KV-cache usage the servers that may use it report


@dataclass(frozen=True)
class GpuInput:
    gpus: tuple[GpuReading, ...] = ()  # the serving GPUs
    reason: str = ""  # why there are none (no NVML, no serving GPU)

    @staticmethod
    def unknown(reason: str) -> "GpuInput":
        return GpuInput(reason=reason)


@dataclass(frozen=True)
class TickInput:
    now: float
    tiers: Mapping[str, TierInput]
    tenants: Mapping[str, TenantInput]
    gpu: GpuInput
    runqueue_p99: float | None = None
    servers: tuple[ServerInput, ...] = ()
    # The latency window: a quantile reflects a cut only once the window has turned over since it.
    window_s: float = 0.0
    # Tiers the resources capability can still take CPU from (ResourcesPart.cpu_held): latency cuts of their
    # requests wait, so that a lower tier loses CPU before it loses requests.
    cpu_held: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TenantState:
    limit: TenantLimit | None = None  # the adaptive limit; None: baseline in force
    origin_rps: float | None = None  # where the first cut started: recovery up to here restores the baseline
    last_cut: float = -math.inf
    shed: bool = False
    shed_to: TenantLimit | None = None  # the limit while shed
    cause: str = ""  # the signal behind the adaptive limit (BY_SLO or BY_SERVER)
    rule: str = ""  # the rule of its last change: cut or raise
    why: str = ""  # the last change's cause, as status shows it


_AT_REST = TenantState()  # a tenant on its baseline, never cut or shed


class _States(dict):  # type: ignore[type-arg]
    """The tenants' states, holding only those ever cut or shed: a tenant not in it is at rest. A tick at rest then
    costs nothing per configured tenant."""

    def __missing__(self, name: str) -> TenantState:
        return _AT_REST


@dataclass(frozen=True)
class ServerState:
    kv: bool = False
    queue: bool = False
    queue_streak: int = 0

    @property
    def pressed(self) -> bool:
        return self.kv or self.queue


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
    # Per GPU: the evidence its memory was last read under, and the lowest ratio seen since that evidence began
    # (growth is judged from it; a change of evidence starts it again).
    gpu_low: Mapping[int, tuple[str, float]] = field(default_factory=dict)
    servers: Mapping[int, ServerState] = field(default_factory=dict)  # by port
    last_server_cut: float = -math.inf

    @property
    def quiet(self) -> bool:
        """Nothing held, shed or building toward a change: no tenant off its baseline, no tier in a breach streak,
        no server or GPU pressed, no breach episode still counting its cuts. From here only new inputs move a
        decision, so ticking slower delays it without changing it; the tick-counted streaks and the recovery that
        waits on healthy ticks are all idle."""
        return (self.shed_tiers == 0 and self.escalation == 0 and not self.gpu_pressure
                and not any(self.breach_streak.values())
                and not any(s.pressed or s.queue_streak for s in self.servers.values())
                and not any(s.shed or s.limit is not None for s in self.tenants.values()))


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
class GpuView:
    """What one serving GPU's memory counted for this tick."""

    index: int
    ratio: float | None
    evidence: str
    counts: bool  # GPU memory is the pressure signal here (memory evidence, and grown or trigger: level)
    why: str  # why it counts or not, as status shows it
    ignored: str = ""  # over `enter` but not acted on: the evidence that overrode it, or NO_GROWTH
    conflict: bool = False  # memory would count as pressure, yet every server that may use the GPU reports KV low


@dataclass(frozen=True)
class SetBy:
    """Which signal and which rule set a tenant's limit in force."""

    signal: str  # BY_CONFIG, BY_SLO, BY_SERVER, BY_GPU
    rule: str  # baseline, cut, raise, shed, and "held at the tier floor" / "held at min_rps" when a floor binds
    detail: str = ""


@dataclass(frozen=True)
class Outcome:
    state: LoopState
    changes: tuple[Change, ...]
    overrides: Mapping[str, TenantLimit]  # what the kernel should enforce instead of the baseline
    part: AdmissionPart
    tiers: Mapping[str, TierView]
    gpus: tuple[GpuView, ...] = ()
    gpu: GpuView | None = None  # of the GPUs whose memory counts, the fullest
    gpu_reason: str = ""  # why no GPU is served or read at all
    run_pre_cleanup: bool = False
    servers: Mapping[int, ServerState] = field(default_factory=dict)
    set_by: Mapping[str, SetBy] = field(default_factory=dict)


def minimum(t: TenantInput, policy: AdmissionConfig, shedding: bool = False) -> float:
    """The lowest rate a path may give a tenant: a cut stops at its tier's floor, or at min_rps where the tier has
    none; a shed (of a sheddable tier: no other is shed) goes to the floor, 0 without one. The one place the floors
    live: cuts, sheds and the status's attribution all ask here."""
    if shedding:
        return t.floor_rps
    return t.floor_rps if t.floor_rps > 0 else policy.min_rps


def shed_limit(t: TenantInput, policy: AdmissionConfig) -> TenantLimit:
    """A shed tenant's limit: no new requests beyond what its floor guarantees (which the quota writer also holds
    the kernel to)."""
    rps = minimum(t, policy, shedding=True)
    return TenantLimit(rps, max(1, t.floor_burst, math.ceil(rps * 0.1)) if rps > 0 else 0)


def effective(t: TenantInput, s: TenantState) -> TenantLimit | None:
    """The limit in force for a tenant: shed, else the adaptive limit, else its baseline."""
    if s.shed and s.shed_to is not None:
        return s.shed_to
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
    floor = minimum(t, policy)
    rps = max(floor, _rate(base * factor))
    if cur is not None and rps >= cur.rps:
        return None
    return TenantLimit(rps, _scaled_burst(cur, rps, t.floor_burst))


def _servers(inp: TickInput, policy: AdmissionConfig, prev: LoopState) -> dict[int, ServerState]:
    """Each server's pressure, with hysteresis. An unknown reading, or an unknown field, presses nothing and ends
    the pressure it held: nothing is decided on a reading that is not there."""
    sp = policy.server_pressure
    out = {}
    for srv in inp.servers:
        st = prev.servers.get(srv.port, ServerState())
        kv_use = srv.kv_cache_usage if srv.known else None
        waiting = srv.requests_waiting if srv.known else None
        kv = kv_use is not None and (kv_use >= sp.kv_exit if st.kv else kv_use > sp.kv_enter)
        streak = st.queue_streak + 1 if waiting is not None and waiting > sp.queue_enter else 0
        queue = waiting is not None and (waiting > sp.queue_exit if st.queue else streak >= sp.queue_ticks)
        out[srv.port] = ServerState(kv, queue, streak)
    return out


def _serves(t: TenantInput, ports: set[int]) -> bool:
    return not t.ports or bool(t.ports & ports)


def decide(inp: TickInput, policy: AdmissionConfig, prev: LoopState) -> Outcome:
    """One tick of the loop, in the order its signals are weighed: the tiers' latency, the servers' pressure, cuts
    (latency first; a server cut only where no latency cut answered the same overload this tick), recovery, GPU
    memory shedding; then the outcome."""
    d = _Tick(inp, policy, prev)
    d.cut_on_breach()
    d.cut_on_server_pressure()
    d.recover()
    d.shed_on_gpu_memory()
    return d.outcome()


class _Tick:
    """The working state of one decide() call: built from its arguments, dropped when it returns (decide stays pure).
    Each step reads and moves the clocks and streaks the LoopState carries from tick to tick."""

    def __init__(self, inp: TickInput, policy: AdmissionConfig, prev: LoopState):
        self.inp, self.policy, self.prev, self.now = inp, policy, prev, inp.now
        self.order = _tier_order(inp.tiers)
        self.states = _States((n, s) for n, s in prev.tenants.items() if n in inp.tenants)
        self.changes: list[Change] = []
        self.escalation, self.since_cut = prev.escalation, prev.ticks_since_cut + 1
        self.last_cut, self.last_change, self.last_server_cut = prev.last_cut, prev.last_change, prev.last_server_cut
        self.run_pre_cleanup = False
        self.held: frozenset[str] = frozenset()
        self._evaluate_tiers()
        self.servers = _servers(inp, policy, prev)
        self.pressed = [srv for srv in inp.servers if self.servers[srv.port].pressed]
        if self.breaching or self.pressed or not self.all_healthy:
            self.healthy_streak = 0
        else:
            self.healthy_streak = prev.healthy_streak + 1

    def _evaluate_tiers(self) -> None:
        """Each tier's quantile against its SLO: breach streaks, breach, near the SLO, and whether all are healthy."""
        policy = self.policy
        self.views: dict[str, TierView] = {}
        self.streak: dict[str, int] = {}
        self.all_healthy = True
        for name in self.order:
            tier = self.inp.tiers[name]
            v = tier.verdict
            self.streak[name] = self.prev.breach_streak.get(name, 0) + 1 if v.over else 0
            if not v.healthy:
                self.all_healthy = False
            self.views[name] = TierView(v.observed, v.slo, self.streak[name], self.streak[name] >= policy.breach_ticks,
                                        v.near)
        self.breaching = [n for n in self.order if self.views[n].in_breach]

    def note(self, tenant: str, extra: Mapping[str, Any]) -> dict[str, Any]:
        """A change's inputs for the audit: the tenant's rates beside what the step saw."""
        t = self.inp.tenants[tenant]
        out: dict[str, Any] = {"tier": t.tier, "admitted_rps": t.admitted_rps, "dropped_rps": t.dropped_rps,
                               "in_flight": t.in_flight}
        if self.inp.runqueue_p99 is not None:
            out["runqueue_p99_s"] = self.inp.runqueue_p99
        # A cut made on one signal while the other also pressed says so: a server-pressure cut taken while gold was
        # in breach answered both, and the breach rule (one cut per window) had no turn of its own.
        if self.breaching:
            out["breaching"] = list(self.breaching)
        out.update(extra)
        return out

    def cut_lowest(self, eligible_tiers: list[str], tenants: list[str], factor: float, reason: str, cause: str,
                   why: str, inputs: Mapping[str, Any]) -> bool:
        """Cut every tenant of the lowest eligible tier that has headroom above its floor; True when one was cut."""
        cuts: dict[str, TenantLimit] = {}
        for name in tenants:
            t = self.inp.tenants[name]
            if t.tier in eligible_tiers and not self.states[name].shed:
                new = _cut_one(t, self.states[name], factor, self.policy)
                if new is not None:
                    cuts[name] = new
        # The lowest tier with headroom takes the whole cut; the next tier up waits until this one is at its floor.
        lowest = next((n for n in eligible_tiers if any(self.inp.tenants[c].tier == n for c in cuts)), None)
        for name, new in cuts.items():
            t = self.inp.tenants[name]
            if t.tier != lowest:
                continue
            s = self.states[name]
            cur = effective(t, s)
            origin = s.origin_rps if s.origin_rps is not None else (cur.rps if cur is not None else t.admitted_rps)
            self.states[name] = replace(s, limit=new, origin_rps=origin, last_cut=self.now, cause=cause, rule=CUT,
                                        why=why)
            self.changes.append(Change(name, CUT, cur, new, reason, self.note(name, inputs)))
        return lowest is not None

    def cut_on_breach(self) -> None:
        """While a tier is in breach. After a cut, the next one waits breach_ticks ticks and a whole latency
        window, so each cut is seen working (or not) before another: cutting on a window that still holds pre-cut
        requests overshoots."""
        inp, policy, now = self.inp, self.policy, self.now
        if not (self.breaching and self.since_cut >= policy.breach_ticks and now - self.last_cut >= inp.window_s):
            return
        driver = self.breaching[-1]  # the most important tier in breach decides how far up the cut may go
        d = inp.tiers[driver]
        factor = policy.cut_factor
        if policy.cut == "gradient":
            factor = min(1.0, max(0.5, d.slo / d.observed)) if d.observed else 1.0
        eligible = [n for n in self.order if inp.tiers[n].weight <= d.weight]
        self.held = frozenset(eligible) & inp.cpu_held
        if self.held:
            return  # resources is still taking CPU from a tier this cut would reach: requests wait
        cause = {"breach_tier": driver, "observed_s": d.observed, "slo_s": d.slo, "quantile": policy.quantile,
                 "factor": round(factor, 4), "escalation": self.escalation}
        why = f"{driver} P{policy.quantile * 100:g} {d.observed or 0:.3f}s > SLO {d.slo:g}s"
        if self.cut_lowest(eligible, list(inp.tenants), factor, SLO_BREACH, BY_SLO, why, cause):
            self.escalation += 1
            self.since_cut = 0
            self.last_cut = self.last_change = now

    def cut_on_server_pressure(self) -> None:
        """The lowest tier with headroom among the tenants a pressed server serves, once per cut_every; one cut a
        tick at most: a latency cut this tick already answers the same overload."""
        sp, now, pressed = self.policy.server_pressure, self.now, self.pressed
        if not (pressed and now - self.last_server_cut >= sp.cut_every and self.last_cut < now):
            return
        ports = {srv.port for srv in pressed}
        srv = max(pressed, key=lambda x: (x.kv_cache_usage or 0, x.requests_waiting or 0))
        st = self.servers[srv.port]
        rule = (f"kv_cache_usage {srv.kv_cache_usage:.2f} > {sp.kv_enter:g}" if st.kv else
                f"requests_waiting {srv.requests_waiting:g} > {sp.queue_enter} for {sp.queue_ticks} ticks")
        cause = {"server": srv.port, "kind": srv.kind, "kv_cache_usage": srv.kv_cache_usage,
                 "requests_waiting": srv.requests_waiting, "rule": rule, "factor": self.policy.cut_factor}
        served = [n for n, t in self.inp.tenants.items() if _serves(t, ports)]
        if self.cut_lowest(self.order, served, self.policy.cut_factor, SERVER_PRESSURE, BY_SERVER,
                           f"server {srv.port}: {rule}", cause):
            self.last_server_cut = self.last_cut = self.last_change = now
            self.since_cut = 0

    def recover(self) -> None:
        """After healthy_ticks, paced and after the cooldown. A raise, like a cut, waits until the window no longer
        holds requests from before the last change."""
        policy, now = self.policy, self.now
        if (self.breaching or self.pressed or self.healthy_streak < policy.healthy_ticks
                or now - self.last_change < self.inp.window_s):
            return
        self.escalation = 0
        raised = False
        for name in self.in_order([n for n, s in self.states.items() if s.limit is not None]):
            t, s = self.inp.tenants[name], self.states[name]
            if s.shed or now - s.last_cut < policy.cooldown:
                continue
            # A limit the tenant does not press against tells nothing about whether more would hurt.
            if t.admitted_rps is None or t.admitted_rps < 0.5 * s.limit.rps:
                continue
            rps = _rate(s.limit.rps * (1.0 + policy.raise_step))
            target = t.baseline.rps if t.baseline is not None else s.origin_rps
            why = {"healthy_ticks": self.healthy_streak, "step": policy.raise_step}
            reason = SERVER_RELIEVED if s.cause == BY_SERVER else SLO_RECOVERED
            if target is None or rps >= target:
                self.states[name] = TenantState(last_cut=s.last_cut)
                self.changes.append(Change(name, RESTORE, s.limit, t.baseline, reason, self.note(name, why)))
            else:
                new = TenantLimit(rps, _scaled_burst(s.limit, rps, t.floor_burst))
                self.states[name] = replace(s, limit=new, rule=RAISE, why=f"{reason}: +{policy.raise_step:g}")
                self.changes.append(Change(name, RAISE, s.limit, new, reason, self.note(name, why)))
            raised = True
        if raised:
            self.healthy_streak = 0
            self.last_change = now

    def weigh_gpus(self) -> None:
        """What each serving GPU's memory counts for: pressure only where nothing but memory speaks for the GPU,
        and there by growth past `enter` while watched (a pre-allocating server's reservation is there from its
        first reading) or, with `trigger: level`, by the level alone."""
        gp, sp = self.policy.gpu_pressure, self.policy.server_pressure
        self.gpu_low: dict[int, tuple[str, float]] = {}
        self.gpu_views: list[GpuView] = []
        for g in self.inp.gpu.gpus:
            prev = self.prev.gpu_low.get(g.index)
            if g.ratio is None:
                # No reading says nothing new: the growth seen so far is kept for when the reading is back.
                if prev is not None:
                    self.gpu_low[g.index] = prev
                self.gpu_views.append(GpuView(g.index, None, g.evidence, False, g.why or "no memory reading"))
                continue
            low = min(prev[1], g.ratio) if prev is not None and prev[0] == g.evidence else g.ratio
            self.gpu_low[g.index] = (g.evidence, low)
            by_memory = gp.trigger == "level" or low <= gp.exit  # what memory alone would say
            over = g.ratio > gp.enter
            mem = f"GPU {g.index} memory {g.ratio:.0%}"
            if g.evidence == MEMORY_EVIDENCE and by_memory:
                grown = f", grown from {low:.0%}" if gp.trigger == "growth" else ""
                self.gpu_views.append(GpuView(g.index, g.ratio, g.evidence, True, mem + grown))
            elif g.evidence == MEMORY_EVIDENCE:
                self.gpu_views.append(GpuView(
                    g.index, g.ratio, g.evidence, False,
                    f"{mem} since it was first read, no growth past {gp.enter:g} seen (gpu_pressure.trigger growth)",
                    NO_GROWTH if over else ""))
            else:
                conflict = (g.evidence == SERVER_EVIDENCE and over and by_memory and g.kv is not None
                            and g.kv < sp.kv_exit)
                self.gpu_views.append(GpuView(g.index, g.ratio, g.evidence, False, f"{g.why} ({mem})",
                                              g.evidence if over else "", conflict))

    def shed_on_gpu_memory(self) -> None:
        """Sheddable tiers only, lowest first, with hysteresis, on the GPUs whose memory counts; where none does
        (unknown, or another reading speaks for the GPU) nothing is shed and what was shed is released."""
        self.weigh_gpus()
        gp, now = self.policy.gpu_pressure, self.now
        pressure, shed_tiers, last_shed = self.prev.gpu_pressure, self.prev.shed_tiers, self.prev.last_shed
        sheddable = [n for n in self.order if self.inp.tiers[n].sheddable]
        counted = [v for v in self.gpu_views if v.counts and v.ratio is not None]
        self.gpu_max = best = max(counted, key=lambda v: (v.ratio, -v.index)) if counted else None
        release_reason = GPU_RELIEVED
        if best is None or best.ratio is None:
            if pressure:
                release_reason = GPU_NOT_EVIDENCE if any(v.ratio is not None for v in self.gpu_views) else GPU_UNKNOWN
            pressure, shed_tiers = False, 0
        elif not pressure and best.ratio > gp.enter:
            pressure, shed_tiers, last_shed, self.run_pre_cleanup = True, min(1, len(sheddable)), now, True
        elif pressure and best.ratio < gp.exit:
            pressure, shed_tiers = False, 0
        elif (pressure and best.ratio > gp.enter and shed_tiers < len(sheddable)
              and now - last_shed >= gp.escalate_after):
            shed_tiers, last_shed = shed_tiers + 1, now
        self.gpu_pressure, self.shed_tiers, self.last_shed = pressure, shed_tiers, last_shed
        shed_set = set(sheddable[:shed_tiers])
        gpu_note: dict[str, Any] = {"gpu": best.index if best else None,
                                    "memory_used_ratio": best.ratio if best else None, "enter": gp.enter,
                                    "exit": gp.exit, "trigger": gp.trigger, "shed_tiers": sorted(shed_set)}
        if best is None:
            gpu_note["gpu_unknown"] = "; ".join(v.why for v in self.gpu_views) or self.inp.gpu.reason
        # Tenants of a shed tier, and those shed before: the others' want and state are both "not shed".
        names = list(self.inp.tenants) if shed_set else self.in_order([n for n, s in self.states.items() if s.shed])
        for name in names:
            t, s = self.inp.tenants[name], self.states[name]
            want = t.tier in shed_set
            if want == s.shed:
                continue
            before = effective(t, s)
            if want:
                assert best is not None
                why = f"GPU {best.index} memory {best.ratio or 0:.0%} > {gp.enter:g}"
                if gp.trigger == "growth":
                    why += f", grown from {self.gpu_low[best.index][1]:.0%}"
                self.states[name] = replace(s, shed=True, shed_to=shed_limit(t, self.policy), why=why)
                self.changes.append(Change(name, SHED, before, self.states[name].shed_to, GPU_PRESSURE,
                                           self.note(name, gpu_note)))
            else:
                self.states[name] = replace(s, shed=False, shed_to=None)
                self.changes.append(Change(name, UNSHED, before, effective(t, self.states[name]), release_reason,
                                           self.note(name, gpu_note)))

    def in_order(self, names: list[str]) -> list[str]:
        """names in the tenants' order (the config's), so that changes are listed alike whichever step made them."""
        if len(names) < 2:
            return names
        want = set(names)
        return [n for n in self.inp.tenants if n in want]

    def outcome(self) -> Outcome:
        overrides = {}
        set_by = {}
        for name in self.in_order([n for n, s in self.states.items() if s.shed or s.limit is not None]):
            t, s = self.inp.tenants[name], self.states[name]
            lim = effective(t, s)
            assert lim is not None
            overrides[name] = lim
            set_by[name] = _set_by(t, s, lim, self.policy)
        state = LoopState(
            tenants=MappingProxyType(self.states),
            breach_streak=MappingProxyType(self.streak),
            healthy_streak=self.healthy_streak,
            escalation=self.escalation,
            ticks_since_cut=self.since_cut,
            last_cut=self.last_cut,
            last_change=self.last_change,
            gpu_pressure=self.gpu_pressure,
            shed_tiers=self.shed_tiers,
            last_shed=self.last_shed,
            gpu_low=MappingProxyType(self.gpu_low),
            servers=MappingProxyType(self.servers),
            last_server_cut=self.last_server_cut,
        )
        part = AdmissionPart(
            near_slo=frozenset(n for n, v in self.views.items() if v.near_slo),
            in_breach=frozenset(self.breaching),
            gpu_pressure=self.gpu_pressure,
            server_pressure=frozenset(srv.port for srv in self.pressed),
            held_for_cpu=self.held,
        )
        return Outcome(state, tuple(self.changes), MappingProxyType(overrides), part, MappingProxyType(self.views),
                       tuple(self.gpu_views), self.gpu_max, self.inp.gpu.reason, self.run_pre_cleanup,
                       MappingProxyType(self.servers), SetByTenant(self.inp.tenants, set_by))


BASELINE = SetBy(BY_CONFIG, "baseline")  # a limit as the config sets it (no override in force)


class SetByTenant(Mapping[str, SetBy]):
    """Outcome.set_by: each tenant's SetBy, those of `moved` as given and every other tenant of `tenants` at the
    config's baseline, answered on lookup rather than written out: a tick at rest costs nothing per tenant."""

    def __init__(self, tenants: Mapping[str, Any], moved: dict[str, SetBy]):
        self._tenants, self._moved = tenants, moved

    def __getitem__(self, name: str) -> SetBy:
        got = self._moved.get(name)
        if got is not None:
            return got
        if name in self._tenants:
            return BASELINE
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)


def _set_by(t: TenantInput, s: TenantState, lim: TenantLimit | None, policy: AdmissionConfig) -> SetBy:
    """The signal and rule behind a tenant's limit in force, and whether a floor is what holds it up."""
    if s.shed:
        signal, rule = BY_GPU, "shed"
    elif s.limit is not None:
        signal, rule = s.cause or BY_SLO, s.rule or CUT
    else:
        return BASELINE
    if lim is not None and lim.rps <= minimum(t, policy, shedding=s.shed):
        rule += ", held at the tier floor" if lim.rps == t.floor_rps and t.floor_rps > 0 else \
            ", shed to 0 (sheddable tier)" if s.shed else ", held at min_rps"
    return SetBy(signal, rule, s.why)
