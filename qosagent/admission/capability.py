"""Closed-loop SLO protection: adaptive per-tenant limits and GPU-memory shedding, written to the quota maps.

The decision itself is policy.decide (pure); this class feeds it the Snapshot, writes its overrides through the
quota capability's LimitsWriter (which expire with the quota heartbeat if the agent dies), runs the pre-cleanup
action, and reports. Without a LimitsWriter it keeps deciding and reporting, writing nothing (effectively dry-run).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any, Container, Iterable

from qosagent.admission import export, policy
from qosagent.admission.inputs import INPUT_PARTS, baseline, same_parts, tick_input
from qosagent.admission.model import ADMISSION, AdmissionPart, GpuAdmission, TenantAdmission, TierAdmission
from qosagent.admission.precleanup import PreCleanup
from qosagent.capability import UNCHANGED, Attention, Capability, Change, State, Verdict
from qosagent.retention import EVERYONE
from qosagent.slo import tier_slos
from qosagent.snapshot import Decision, Snapshot
from qosagent.tenants import LIMITS_SERVICE, LimitsWriter, TenantLimit

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config, TenantConfig
    from qosagent.features import Features



def _rps(limit: TenantLimit | None) -> float | None:
    return None if limit is None else limit.rps


def _row(t: "TenantConfig", baseline: TenantLimit | None, limit: TenantLimit | None, shed: bool, adaptive: bool,
         by: policy.SetBy) -> TenantAdmission:
    """A tenant's row of the report."""
    return TenantAdmission(t.name, t.tier, baseline, limit, shed, adaptive, by.signal, by.rule, by.detail)


def _gpu_line(out: policy.Outcome, dry_run: bool) -> str:
    """The status's GPU field: pressure, or why memory over `enter` sheds nothing ("would not shed: the server
    reports KV 30 % ..." in dry-run), or the fullest GPU whose memory counts."""
    best, views = out.gpu, out.gpus
    if out.state.gpu_pressure and best is not None:
        return f"pressure (max {best.ratio or 0:.1%} on GPU {best.index})"
    ignored = [v.why for v in views if v.ignored]
    if ignored:
        return f"{'would not shed' if dry_run else 'not shedding'}: {'; '.join(ignored)}"
    if best is not None:
        return f"ok (max {best.ratio or 0:.1%} on GPU {best.index})"
    if any(v.ratio is not None for v in views):
        return f"ok ({'; '.join(v.why for v in views if v.ratio is not None)})"
    return f"unknown ({'; '.join(v.why for v in views) or out.gpu_reason})"


class Admission(Capability):
    name = "admission"

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.state = policy.LoopState()
        self.outcome: policy.Outcome | None = None
        self.baseline: dict[str, TenantLimit] = {}
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.ignored: collections.Counter[tuple[int, str]] = collections.Counter()  # (gpu, why) -> ticks
        self.pre_cleanup = PreCleanup()
        self._written = False  # overrides were written and must be withdrawn when we stop writing
        self._published: AdmissionPart | None = None  # the last part settled: the next tick's collected one
        # Worked out once per config rather than every tick: its tenants by name, their baselines (the config's, as
        # quota's part carries them), and each tenant's report while at rest (no adaptive limit, no shed).
        self._for: Any = None
        self._index: dict[str, Any] = {}
        self._at_rest: dict[str, TenantAdmission] = {}
        self._all_at_rest: tuple[TenantAdmission, ...] = ()  # the report's rows while no tenant is cut or shed
        self._tier_slo: dict[str, float] = {}  # the SLO of each tier with tenants (slo.tier_slos), per config
        # The last input, and what it was made of: (config, baseline, the parts it read).
        self._input: tuple[tuple[Any, Any, tuple[Any, ...]], policy.TickInput] | None = None
        self._steady = False  # this tick's servers' and GPUs' readings were the tick before's

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def _writer(self) -> LimitsWriter | None:
        return self.ctx.services.get(LIMITS_SERVICE)

    def _enforcing(self) -> bool:
        return self.ctx.config.admission.mode == "enforce" and self._writer() is not None

    def probe(self, features: "Features") -> Verdict:
        cfg = self.ctx.config.admission
        problems = []
        known = {d.index for d in self.ctx.gpu.devices()}
        missing = sorted(set(cfg.gpu_pressure.gpus) - known)
        if missing and known:
            problems.append(f"gpu_pressure.gpus names GPUs the backend does not report: {missing}")
        if cfg.signal == "ttft" and self.ctx.config.latency.enabled and not features.cgroup2:
            problems.append("admission.signal is ttft, but without a cgroup v2 hierarchy the latency egress program "
                            "cannot read responses: no TTFT, so no SLO breach can be seen; set admission.signal to "
                            "headers or response on this host")
        if cfg.mode == "enforce" and not self.ctx.offered(LIMITS_SERVICE) and self._writer() is None:
            problems.append("mode enforce but quota is not enabled or not running: computing and reporting only "
                            "(effectively dry-run)")
        if problems:
            return Verdict(State.DEGRADED, "; ".join(problems))
        if cfg.mode == "dry-run":
            return Verdict(State.ACTIVE, "dry-run: computes and reports, writes nothing")
        return Verdict(State.ACTIVE)

    def stop(self) -> None:
        # A pre-cleanup still running is let finish (its own timeout kills it) rather than orphaned by our exit.
        pc = self.ctx.config.admission.gpu_pressure.pre_cleanup
        if pc is not None:
            self.pre_cleanup.wait(pc.timeout + 1)
        writer = self._writer()
        if self._written and writer is not None:
            writer.set_overrides({})
            self._written = False

    def prepare(self, config: "Config") -> Change:
        # The policy reads its config each tick: nothing to write, only a warning worth giving before it takes.
        if config.admission.mode == "enforce" and self._writer() is None:
            self.log.warning("mode enforce without a running quota capability: limits are computed, not written")
        return UNCHANGED

    # ---- one tick ----------------------------------------------------------------------------------------
    def collect(self) -> AdmissionPart:
        # Admission reads nothing of its own: what it decides on is in this tick's snapshot (the SLO verdict latency's
        # collect judged, QuotaPart's baselines, the servers' and GPUs' parts). Until decide has run, the part is
        # the last one published, for metrics and status only; nobody decides on it (DVFS reads the verdict).
        if self._published is None:
            self._published = self._report()
        return self._published

    def settled(self, part: AdmissionPart) -> AdmissionPart:
        self._published = self._report()
        return self._published

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        cfg = self.ctx.config
        if self._for is not cfg:
            self._for, self.baseline = cfg, baseline(snapshot, cfg)
            self._index = {t.name: t for t in cfg.tenants}
            self._at_rest = {t.name: _row(t, self.baseline.get(t.name), self.baseline.get(t.name), False, False,
                                          policy.BASELINE) for t in cfg.tenants}
            self._all_at_rest = tuple(self._at_rest.values())
            self._tier_slo = tier_slos(cfg)
        # The parts it reads handed on from the tick before (a tick at rest: latency's and quota's are the same
        # objects), the same input at this tick's time.
        made = (cfg, self.baseline, tuple(snapshot.part(k) for k in INPUT_PARTS))
        last = self._input
        if last is not None and last[0][0] is cfg and last[0][1] is self.baseline and same_parts(last[0][2], made[2]):
            inp = dataclasses.replace(last[1], now=snapshot.monotonic)
        else:
            inp = tick_input(snapshot, cfg, self.baseline, self._index, self._tier_slo)
        # The servers' and GPUs' readings as the tick before's: a reading that moves (a GPU's memory dipping between
        # two reads, which the growth trigger judges by its lowest) keeps the loop at interval, as tenants' do.
        self._steady = last is not None and inp.gpu == last[1].gpu and inp.servers == last[1].servers
        self._input = (made, inp)
        out = policy.decide(inp, cfg.admission, self.state)
        self.state = out.state
        self.outcome = out
        for v in out.gpus:
            if v.ignored:
                self.ignored[(v.index, v.ignored)] += 1
        applied = self._enforcing()
        decisions = []
        for c in out.changes:
            self.counts[(c.tenant, c.action, c.reason)] += 1
            inputs = dict(c.inputs)
            inputs["old"], inputs["new"] = export.fmt(c.old), export.fmt(c.new)
            inputs["tick"] = snapshot.seq
            decisions.append(Decision(self.name, c.tenant, c.action, _rps(c.old), _rps(c.new), c.reason, inputs,
                                      applied=applied, wall_time=snapshot.wall_time,
                                      shown=f"{inputs['old']} -> {inputs['new']}"))
        return decisions

    def quiet(self) -> bool:
        # A change made this tick keeps the loop awake as every decision does (the daemon's); a pre-cleanup run
        # comes with GPU pressure, which LoopState.quiet counts.
        return self._steady and self.outcome is not None and self.outcome.state.quiet

    def apply(self, decisions: list[Decision]) -> None:
        out = self.outcome
        if out is None:
            return
        writer = self._writer()
        if self._enforcing():
            assert writer is not None
            # Every tick, not only on change: the same overrides again are a no-op on the quota side (no slot is
            # walked). A reset there needs no call of ours: a reload's write_config writes the overrides it holds
            # into every slot, and a new Datapath (re-adopted pins) remembers none, so this tick's call writes them.
            writer.set_overrides(out.overrides)
            self._written = bool(out.overrides)
        elif self._written and writer is not None:
            # Switched to dry-run by a reload: what we wrote must not stay in force.
            writer.set_overrides({})
            self._written = False
        pc = self.ctx.config.admission.gpu_pressure.pre_cleanup
        if out.run_pre_cleanup and pc is not None and out.gpu is not None:
            why = f"GPU {out.gpu.index} memory {out.gpu.ratio or 0:.1%}"
            if self._enforcing():
                self.pre_cleanup.trigger(pc, why)
            else:
                self.log.info("dry-run: would run the pre-cleanup (%s)", why)

    # ---- reporting ----------------------------------------------------------------------------------------
    def _report(self) -> AdmissionPart:
        """The last decision as the Snapshot carries it: everything metrics and status show."""
        cfg = self.ctx.config
        out = self.outcome
        common = dict(mode=cfg.admission.mode, enforcing=self._enforcing(), quantile=cfg.admission.quantile,
                      signal=cfg.admission.signal, decisions=dict(self.counts),
                      pre_cleanup_runs=dict(self.pre_cleanup.results), pre_cleanup_last=dict(self.pre_cleanup.last))
        if out is None:
            return AdmissionPart(**common)  # type: ignore[arg-type]
        state = out.state
        gpu = _gpu_line(out, dry_run=not self._enforcing())
        # Only the tenants cut or shed are built anew; the rest are at rest, as reported since the config came.
        moved = {}
        for name, s in state.tenants.items():
            t = self._index.get(name)
            if t is None or not (s.shed or s.limit is not None):
                continue
            base = self.baseline.get(name)
            moved[name] = _row(t, base, out.overrides.get(name, base), s.shed, s.limit is not None,
                               out.set_by.get(name) or policy.BASELINE)
        tenants = tuple(moved.get(n) or t for n, t in self._at_rest.items()) if moved else self._all_at_rest
        return dataclasses.replace(
            out.part, decided=True, gpu=gpu, shed_tiers=state.shed_tiers, escalation=state.escalation,
            healthy_streak=state.healthy_streak, servers_known=tuple(sorted(out.servers)),
            tiers=tuple(TierAdmission(n, v.observed, v.slo, v.breach_streak, v.in_breach, v.near_slo)
                        for n, v in out.tiers.items()),
            tenants=tenants,
            gpus=tuple(GpuAdmission(v.index, v.ratio, v.evidence, v.counts, v.why, v.conflict) for v in out.gpus),
            gpu_ignored=dict(self.ignored), **common)

    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable[Metric]:
        part = snapshot.part(ADMISSION)
        return export.metrics(part, shown) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(ADMISSION)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)

    @staticmethod
    def attention(status: dict[str, Any]) -> dict[str, Attention]:
        return export.attention(status)
