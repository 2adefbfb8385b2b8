"""Closed-loop SLO protection: adaptive per-tenant limits and GPU-memory shedding, written to the quota maps.

The decision itself is policy.decide (pure); this class feeds it the Snapshot, writes its overrides through the
quota capability's LimitsWriter (which expire with the quota heartbeat if the agent dies), runs the pre-cleanup
action, and reports. Without a LimitsWriter it keeps deciding and reporting, writing nothing (effectively dry-run).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from qosagent.admission import policy
from qosagent.admission.inputs import config_baseline, tick_input
from qosagent.admission.model import AdmissionPart
from qosagent.admission.precleanup import PreCleanup
from qosagent.capability import UNCHANGED, Capability, Change, State, Verdict
from qosagent.snapshot import Decision, Snapshot
from qosagent.tenants import LimitsWriter, TenantLimit

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.features import Features

LIMITS_SERVICE = "quota.limits"


def _rps(limit: TenantLimit | None) -> float | None:
    return None if limit is None else limit.rps


def _fmt(limit: TenantLimit | None) -> str:
    return "unlimited" if limit is None else f"{limit.rps:g}/s burst {limit.burst}"


class Admission(Capability):
    name = "admission"

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        self.state = policy.LoopState()
        self.outcome: policy.Outcome | None = None
        self.baseline: dict[str, TenantLimit] = {}
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.pre_cleanup = PreCleanup()
        self._written = False  # overrides were written and must be withdrawn when we stop writing

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
        quota = self.ctx.verdicts.get("quota")
        quota_runs = quota is not None and quota.state in (State.ACTIVE, State.DEGRADED)
        if cfg.mode == "enforce" and not quota_runs and self._writer() is None:
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
        # The tick's parts are collected before any decision, so this is what the previous tick decided.
        return self.outcome.part if self.outcome is not None else AdmissionPart()

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        cfg = self.ctx.config
        writer = self._writer()
        self.baseline = dict(writer.baseline()) if writer is not None else config_baseline(cfg)
        inp = tick_input(snapshot, cfg, self.baseline)
        out = policy.decide(inp, cfg.admission, self.state)
        self.state = out.state
        self.outcome = out
        applied = self._enforcing()
        decisions = []
        for c in out.changes:
            self.counts[(c.tenant, c.action, c.reason)] += 1
            inputs = dict(c.inputs)
            inputs["old"], inputs["new"] = _fmt(c.old), _fmt(c.new)
            inputs["tick"] = snapshot.seq
            decisions.append(Decision(self.name, c.tenant, c.action, _rps(c.old), _rps(c.new), c.reason, inputs,
                                      applied=applied, wall_time=snapshot.wall_time,
                                      shown=f"{inputs['old']} -> {inputs['new']}"))
        return decisions

    def apply(self, decisions: list[Decision]) -> None:
        out = self.outcome
        if out is None:
            return
        writer = self._writer()
        if self._enforcing():
            assert writer is not None
            # Every tick, not only on change: replacing is idempotent, and it re-asserts the limits should the
            # quota side have been reset (a reload, re-adopted pins).
            writer.set_overrides(out.overrides)
            self._written = bool(out.overrides)
        elif self._written and writer is not None:
            # Switched to dry-run by a reload: what we wrote must not stay in force.
            writer.set_overrides({})
            self._written = False
        pc = self.ctx.config.admission.gpu_pressure.pre_cleanup
        if out.run_pre_cleanup and pc is not None:
            why = f"GPU {out.gpu.gpu} memory {out.gpu.ratio or 0:.1%}"
            if self._enforcing():
                self.pre_cleanup.trigger(pc, why)
            else:
                self.log.info("dry-run: would run the pre-cleanup (%s)", why)

    # ---- reporting ---------------------------------------------------------------------------------------
    def _limits(self) -> dict[str, TenantLimit | None]:
        out = self.outcome
        limits: dict[str, TenantLimit | None] = {}
        for t in self.ctx.config.tenants:
            if out is not None and t.name in out.overrides:
                limits[t.name] = out.overrides[t.name]
            else:
                limits[t.name] = self.baseline.get(t.name)
        return limits

    def metrics(self, snapshot: Snapshot) -> Iterable[Metric]:
        decisions = CounterMetricFamily("qosagent_admission_decisions", "Limit changes decided, by tenant, action "
                                        "and reason (dry-run ones included)", labels=["tenant", "action", "reason"])
        for (tenant, action, reason), n in sorted(dict(self.counts).items()):
            decisions.add_metric([tenant, action, reason], n)
        yield decisions
        limit = GaugeMetricFamily("qosagent_admission_limit_rps", "Request starts per second in force (or that "
                                  "would be in dry-run) per tenant; +Inf when unlimited", labels=["tenant", "tier"])
        tiers = {t.name: t.tier for t in self.ctx.config.tenants}
        for tenant, lim in self._limits().items():
            limit.add_metric([tenant, tiers[tenant]], math.inf if lim is None else lim.rps)
        yield limit
        yield GaugeMetricFamily("qosagent_admission_enforcing", "1 when limits are written to the quota maps",
                                value=1.0 if self._enforcing() else 0.0)
        out = self.outcome
        if out is not None:
            q = GaugeMetricFamily("qosagent_admission_tier_latency_seconds", "The policy's latency quantile per "
                                  "tier over the latency window", labels=["tier"])
            breach = GaugeMetricFamily("qosagent_admission_tier_in_breach", "1 while a tier is in SLO breach",
                                       labels=["tier"])
            for tier, v in out.tiers.items():
                if v.observed is not None:
                    q.add_metric([tier], v.observed)
                breach.add_metric([tier], 1.0 if v.in_breach else 0.0)
            yield q
            yield breach
            yield GaugeMetricFamily("qosagent_admission_shed_tiers", "Tiers whose new requests are refused for GPU "
                                    "memory pressure", value=out.state.shed_tiers)
            pressed = GaugeMetricFamily("qosagent_admission_server_pressure", "1 while the server on the port is "
                                        "pressed (KV cache or queue over its enter threshold)", labels=["port"])
            for port, st in sorted(out.servers.items()):
                pressed.add_metric([str(port)], 1.0 if st.pressed else 0.0)
            yield pressed
            # Enforce-mode shedding and dry-run "would shed" are told apart with qosagent_admission_enforcing.
            limited = GaugeMetricFamily("qosagent_admission_limited", "1 while admission holds the tenant below its "
                                        "configured limit (or would, in dry-run), by the signal that set it",
                                        labels=["tenant", "tier", "cause"])
            for t in self.ctx.config.tenants:
                by = out.set_by.get(t.name)
                if by is not None and by.signal != policy.BY_CONFIG:
                    limited.add_metric([t.name, t.tier, by.signal], 1.0)
            yield limited
        runs = CounterMetricFamily("qosagent_admission_pre_cleanup_runs", "Pre-cleanup actions by result",
                                   labels=["result"])
        for result, n in sorted(dict(self.pre_cleanup.results).items()):
            runs.add_metric([result], n)
        yield runs

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        out = self.outcome
        cfg = self.ctx.config
        state = out.state if out is not None else self.state
        gpu = "unknown"
        if out is not None and out.gpu.reason and not out.gpu.known:
            gpu = f"unknown ({out.gpu.reason})"  # what sheds nothing: no NVML, a lost GPU, a pre-allocated GPU
        if out is not None and out.gpu.known:
            gpu = f"{'pressure' if state.gpu_pressure else 'ok'} (max {out.gpu.ratio or 0:.1%} on GPU {out.gpu.gpu})"
        tenants = []
        limits = self._limits()
        for t in cfg.tenants:
            s = state.tenants.get(t.name, policy.TenantState())
            by = out.set_by.get(t.name) if out is not None else None
            tenants.append({"tenant": t.name, "tier": t.tier, "baseline": _fmt(self.baseline.get(t.name)),
                            "limit": _fmt(limits[t.name]), "shed": s.shed, "adaptive": s.limit is not None,
                            "signal": by.signal if by else policy.BY_CONFIG, "rule": by.rule if by else "baseline",
                            "why": by.detail if by else ""})
        return {
            "mode": cfg.admission.mode,
            "enforcing": self._enforcing(),
            "quantile": cfg.admission.quantile,
            "signal": cfg.admission.signal,
            "gpu": gpu,
            "shed_tiers": state.shed_tiers,
            "server_pressure": sorted(p for p, st in state.servers.items() if st.pressed),
            "escalation": state.escalation,
            "healthy_streak": state.healthy_streak,
            "tiers": {n: {"observed_s": v.observed, "slo_s": v.slo, "breach_streak": v.breach_streak,
                          "in_breach": v.in_breach, "near_slo": v.near_slo}
                      for n, v in (out.tiers.items() if out is not None else ())},
            "tenants": tenants,
            "pre_cleanup": dict(self.pre_cleanup.last),
        }

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        if "mode" not in status:  # the agent could not build this part; say so instead of failing the whole view
            return f"ADMISSION  {status.get('error', 'no status')}"

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1000:.1f}ms"

        pressed = ",".join(map(str, status.get("server_pressure", ())))
        head = (f"ADMISSION  mode {status['mode']}{'' if status['enforcing'] else ' (not writing)'}  "
                f"P{status['quantile'] * 100:g} {status['signal']}  GPU {status['gpu']}"
                f"{'  shed tiers ' + str(status['shed_tiers']) if status['shed_tiers'] else ''}"
                f"{'  servers pressed ' + pressed if pressed else ''}")
        lines = [head, "TIER         OBSERVED   SLO        STATE"]
        for tier, v in status["tiers"].items():
            st = "BREACH" if v["in_breach"] else f"over {v['breach_streak']}" if v["breach_streak"] else \
                "near" if v["near_slo"] else "ok"
            lines.append(f"{tier:<12} {ms(v['observed_s']):<10} {ms(v['slo_s']):<10} {st}")
        lines.append("TENANT         TIER       BASELINE               LIMIT                  SET BY")
        for t in status["tenants"]:
            flag = " SHED" if t["shed"] else ""
            by = f"{t['signal']}: {t['rule']}" + (f" ({t['why']})" if t.get("why") else "")
            lines.append(f"{t['tenant']:<14} {t['tier']:<10} {t['baseline']:<22} {t['limit'] + flag:<22} {by}")
        pc = status.get("pre_cleanup")
        if pc:
            lines.append(f"last pre-cleanup: {pc['result']}: {pc['detail']}")
        return "\n".join(lines)
