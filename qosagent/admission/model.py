"""The admission capability's part of the Snapshot (what DVFS and status read)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionPart:
    # Tiers whose measured quantile is at or above a configured fraction of their SLO: DVFS must not lower
    # frequency for load or power reasons while this is non-empty.
    near_slo: frozenset[str] = frozenset()
    in_breach: frozenset[str] = frozenset()
    gpu_pressure: bool = False
    server_pressure: frozenset[int] = frozenset()  # ports of the servers pressed this tick
