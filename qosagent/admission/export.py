"""What admission shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Container, Iterable

from prometheus_client.core import Metric

from qosagent.admission.model import AdmissionPart
from qosagent.admission.policy import BY_CONFIG
from qosagent.capability import Attention
from qosagent.exposition import Family, families, one
from qosagent.retention import EVERYONE
from qosagent.tenants import TenantLimit


def fmt(limit: TenantLimit | None) -> str:
    return "unlimited" if limit is None else f"{limit.rps:g}/s burst {limit.burst}"


def _decided(part: AdmissionPart) -> bool:
    return part.decided


FAMILIES: tuple[Family[AdmissionPart], ...] = (
    Family("qosagent_admission_decisions", "counter", "Limit changes decided, by tenant, action and reason (dry-run "
           "ones included)", ("tenant", "action", "reason"),
           lambda p: (([tenant, action, reason], n) for (tenant, action, reason), n in sorted(p.decisions.items()))),
    Family("qosagent_admission_limit_rps", "gauge", "Request starts per second in force (or that would be in "
           "dry-run) per tenant; +Inf when unlimited", ("tenant", "tier"),
           lambda p: (([t.tenant, t.tier], math.inf if t.limit is None else t.limit.rps) for t in p.tenants)),
    Family("qosagent_admission_enforcing", "gauge", "1 when limits are written to the quota maps", (),
           one(lambda p: 1.0 if p.enforcing else 0.0)),
    Family("qosagent_admission_tier_latency_seconds", "gauge", "The policy's latency quantile per tier over the "
           "latency window", ("tier",), lambda p: (([v.tier], v.observed) for v in p.tiers if v.observed is not None),
           shown=_decided),
    Family("qosagent_admission_tier_in_breach", "gauge", "1 while a tier is in SLO breach", ("tier",),
           lambda p: (([v.tier], 1.0 if v.in_breach else 0.0) for v in p.tiers), shown=_decided),
    Family("qosagent_admission_shed_tiers", "gauge", "Tiers whose new requests are refused for GPU memory pressure",
           (), one(lambda p: p.shed_tiers), shown=_decided),
    Family("qosagent_admission_server_pressure", "gauge", "1 while the server on the port is pressed (KV cache or "
           "queue over its enter threshold)", ("port",),
           lambda p: (([str(port)], 1.0 if port in p.server_pressure else 0.0) for port in p.servers_known),
           shown=_decided),
    # Enforce-mode shedding and dry-run "would shed" are told apart with qosagent_admission_enforcing.
    Family("qosagent_admission_limited", "gauge", "1 while admission holds the tenant below its configured limit (or "
           "would, in dry-run), by the signal that set it", ("tenant", "tier", "cause"),
           lambda p: (([t.tenant, t.tier, t.signal], 1.0) for t in p.tenants if t.signal != BY_CONFIG),
           shown=_decided),
    Family("qosagent_admission_evidence_conflict", "gauge", "1 while a serving GPU's memory would count as pressure "
           "(grown past enter, or over it with trigger level) yet every server that may use the GPU reports its KV "
           "cache low: worth a look, not an action", ("gpu",),
           lambda p: (([str(g.gpu)], 1.0 if g.conflict else 0.0) for g in p.gpus if g.memory_used_ratio is not None),
           shown=_decided),
    Family("qosagent_admission_gpu_memory_ignored", "counter", "Ticks a serving GPU's memory was over "
           "gpu_pressure.enter and shed nothing, by what overrode it (server: a server's reading; missing: a server or "
           "process with no reading; no_growth)", ("gpu", "evidence"),
           lambda p: (([str(gpu), why], n) for (gpu, why), n in sorted(p.gpu_ignored.items()))),
    Family("qosagent_admission_pre_cleanup_runs", "counter", "Pre-cleanup actions by result", ("result",),
           lambda p: (([result], n) for result, n in sorted(p.pre_cleanup_runs.items()))),
)


def metrics(part: AdmissionPart, shown: Container[str] = EVERYONE) -> Iterable[Metric]:
    """Its families; a tenant's series while it is shown (metrics.retention) or admission holds it below its
    configured limit (an alert's subject, idle or not)."""
    if shown is not EVERYONE:
        part = dataclasses.replace(part, tenants=tuple(t for t in part.tenants
                                                       if t.tenant in shown or t.signal != BY_CONFIG))
    return families(FAMILIES, part)


def status(part: AdmissionPart) -> dict[str, Any]:
    return {
        "mode": part.mode,
        "enforcing": part.enforcing,
        "quantile": part.quantile,
        "signal": part.signal,
        "gpu": part.gpu,
        "shed_tiers": part.shed_tiers,
        "server_pressure": sorted(part.server_pressure),
        "held_for_cpu": sorted(part.held_for_cpu),
        "escalation": part.escalation,
        "healthy_streak": part.healthy_streak,
        "gpus": [{"gpu": g.gpu, "memory_used_ratio": g.memory_used_ratio, "evidence": g.evidence, "counts": g.counts,
                  "why": g.why, "conflict": g.conflict} for g in part.gpus],
        "tiers": {v.tier: {"observed_s": v.observed, "slo_s": v.slo, "breach_streak": v.breach_streak,
                           "in_breach": v.in_breach, "near_slo": v.near_slo} for v in part.tiers},
        "tenants": [{"tenant": t.tenant, "tier": t.tier, "baseline": fmt(t.baseline), "limit": fmt(t.limit),
                     "shed": t.shed, "adaptive": t.adaptive, "signal": t.signal, "rule": t.rule, "why": t.why}
                    for t in part.tenants],
        "pre_cleanup": dict(part.pre_cleanup_last),
    }


def attention(st: dict[str, Any]) -> dict[str, Attention]:
    """Per tenant: throttled while admission holds it below its configured limit (or would, in dry-run)."""
    return {t["tenant"]: Attention(throttled=t.get("signal", BY_CONFIG) != BY_CONFIG or bool(t.get("shed")))
            for t in st.get("tenants", [])}


def render(status: dict[str, Any]) -> str:
    if "mode" not in status:  # the agent could not build this part; say so instead of failing the whole view
        return f"ADMISSION  {status.get('error', 'no status')}"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}ms"

    pressed = ",".join(map(str, status.get("server_pressure", ())))
    held = ",".join(status.get("held_for_cpu", ()))
    head = (f"ADMISSION  mode {status['mode']}{'' if status['enforcing'] else ' (not writing)'}  "
            f"P{status['quantile'] * 100:g} {status['signal']}  GPU {status['gpu']}"
            f"{'  shed tiers ' + str(status['shed_tiers']) if status['shed_tiers'] else ''}"
            f"{'  servers pressed ' + pressed if pressed else ''}"
            f"{'  cuts wait: resources takes CPU from ' + held if held else ''}")
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
