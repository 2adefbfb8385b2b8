"""The DVFS capability's part of the Snapshot, and the typed commands its decisions carry to apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping
from qosagent.snapshot import PartKey


@dataclass(frozen=True)
class PolicyView:
    name: str
    cpus: tuple[int, ...]
    driver: str
    governor: str
    actuator: str | None
    point: str | None
    target_khz: int | None
    cur_khz: int | None
    load: float | None
    transitions: int
    kind: str
    reason: str
    held: str
    note: str  # why this policy is not (or no longer) actuated


@dataclass(frozen=True)
class DvfsPart:
    mode: str
    temperatures: Mapping[str, float]
    hottest_c: float | None
    critical_c: float | None
    emergency: bool
    policies: tuple[PolicyView, ...]
    gpu_bands: Mapping[int, str | None]
    gpu_off: Mapping[str, str]
    bad_readings: Mapping[tuple[str, str], int]
    writes: Mapping[str, int]


@dataclass(frozen=True)
class SetFreq:
    """Cap one cpufreq policy at the frequency of an operating point."""

    policy: str
    khz: int
    point: str


@dataclass(frozen=True)
class GpuBandChange:
    """Put one GPU in a band (its clocks and power limit), or out of every band (None: the originals back)."""

    gpu: int
    band: str | None


DVFS = PartKey("dvfs", DvfsPart)
