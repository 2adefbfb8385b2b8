"""The admission capability's part of the Snapshot: what the last tick decided, as DVFS, metrics and status read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from qosagent.tenants import TenantLimit
from qosagent.snapshot import PartKey


@dataclass(frozen=True)
class TierAdmission:
    tier: str
    observed: float | None  # the policy's quantile of the tier's signal over the window
    slo: float
    breach_streak: int
    in_breach: bool
    near_slo: bool


@dataclass(frozen=True)
class TenantAdmission:
    tenant: str
    tier: str
    baseline: TenantLimit | None  # None: unlimited
    limit: TenantLimit | None  # in force (or that would be, in dry-run)
    shed: bool
    adaptive: bool
    signal: str  # which signal set the limit (config, slo, server, gpu)
    rule: str  # which rule (baseline, cut, raise, shed, held at a floor)
    why: str = ""


@dataclass(frozen=True)
class GpuAdmission:
    """What a serving GPU's memory counted for (docs/admission.md, "GPU memory: evidence first")."""

    gpu: int
    memory_used_ratio: float | None
    evidence: str  # server, missing, memory, unknown
    counts: bool  # memory is the pressure signal on this GPU
    why: str
    conflict: bool = False  # memory would count as pressure while every server that may use the GPU reports KV low


@dataclass(frozen=True)
class AdmissionPart:
    # Tiers whose measured quantile is at or above a configured fraction of their SLO: DVFS must not lower
    # frequency for load or power reasons while this is non-empty.
    near_slo: frozenset[str] = frozenset()
    in_breach: frozenset[str] = frozenset()
    gpu_pressure: bool = False
    server_pressure: frozenset[int] = frozenset()  # ports of the servers pressed this tick
    # Tiers whose latency cut waited this tick because the resources capability can still take CPU from them.
    held_for_cpu: frozenset[str] = frozenset()
    # The rest is the report of the same tick, for metrics and status.
    decided: bool = False  # False before the first decision: nothing below is known yet
    mode: str = ""
    enforcing: bool = False
    quantile: float = 0.0
    signal: str = ""
    gpu: str = "unknown"
    shed_tiers: int = 0
    escalation: int = 0
    healthy_streak: int = 0
    servers_known: tuple[int, ...] = ()  # ports with a pressure state, pressed or not
    tiers: tuple[TierAdmission, ...] = ()
    tenants: tuple[TenantAdmission, ...] = ()
    gpus: tuple[GpuAdmission, ...] = ()
    # (gpu, evidence or no_growth) -> ticks its memory was over `enter` and not acted on, by what overrode it
    gpu_ignored: Mapping[tuple[int, str], int] = field(default_factory=dict)
    decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # (tenant, action, reason) -> n
    pre_cleanup_runs: Mapping[str, int] = field(default_factory=dict)  # by result
    pre_cleanup_last: Mapping[str, str] = field(default_factory=dict)


ADMISSION = PartKey("admission", AdmissionPart)
