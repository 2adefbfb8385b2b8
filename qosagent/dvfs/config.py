from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from qosagent.configbase import RESTART, Duration, Mode, Section

_FREQ = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|khz|mhz|ghz)\s*$", re.IGNORECASE)
_KHZ = {"khz": 1, "mhz": 1000, "ghz": 1000_000}
_WATTS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|w)\s*$", re.IGNORECASE)


def parse_freq(value: str) -> tuple[str, float]:
    """("khz", kHz) for an absolute frequency such as 800MHz, ("pct", 50.0) for 50% of cpuinfo_max_freq."""
    m = _FREQ.match(value)
    if not m:
        raise ValueError(f"expected a frequency such as 800MHz, 1.6GHz or 50%, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"a relative frequency is a percentage of cpuinfo_max_freq in (0, 100], got {value!r}")
        return "pct", number
    return "khz", number * _KHZ[unit]


def parse_power(value: str) -> tuple[str, float]:
    """("w", watts) or ("pct", percent of the GPU's maximum power limit)."""
    m = _WATTS.match(value)
    if not m:
        raise ValueError(f"expected a power limit such as 500W or 80%, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%" and not 0 < number <= 100:
        raise ValueError(f"a relative power limit is a percentage in (0, 100], got {value!r}")
    return ("pct" if unit == "%" else "w"), number


class OperatingPoint(Section):
    """One row of the table: inputs inside [from, below) of every bound given select `freq`.

    Rows are matched top to bottom; the last row must have no bounds so that every input selects a point."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,30}$")
    temp_from_c: float | None = None
    temp_below_c: float | None = None
    load_from_pct: float | None = Field(default=None, ge=0, le=100)
    load_below_pct: float | None = Field(default=None, ge=0, le=100)
    freq: str
    # energy_performance_preference for policies that offer it; None leaves the host's own value in place.
    epp: str | None = None

    @field_validator("freq")
    @classmethod
    def _freq(cls, v: str) -> str:
        parse_freq(v)
        return v

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.temp_from_c, self.temp_below_c, self.load_from_pct,
                                            self.load_below_pct))


def _default_points() -> list[OperatingPoint]:
    # The design's table, first match wins. Hot wins over everything; what the design leaves open (cool but busy,
    # warm but idle or saturated) runs unlimited, so the default only ever takes frequency away where it said so.
    return [
        OperatingPoint(name="hot", temp_from_c=85, freq="400MHz", epp="power"),
        OperatingPoint(name="cool-idle", temp_below_c=60, load_below_pct=30, freq="800MHz", epp="balance_power"),
        OperatingPoint(name="warm", temp_from_c=60, temp_below_c=85, load_from_pct=30, load_below_pct=75,
                       freq="1600MHz", epp="balance_performance"),
        OperatingPoint(name="full", freq="100%"),
    ]


class GpuBand(Section):
    """From `from_c` (GPU temperature) up: lock the SM clocks and/or cap the power limit. Highest matching band wins."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,30}$")
    from_c: float
    locked_clocks_mhz: tuple[int, int] | None = None
    power_limit: str | None = None

    @field_validator("power_limit")
    @classmethod
    def _power(cls, v: str | None) -> str | None:
        if v is not None:
            parse_power(v)
        return v

    @model_validator(mode="after")
    def _clocks(self) -> "GpuBand":
        if self.locked_clocks_mhz and not 0 < self.locked_clocks_mhz[0] <= self.locked_clocks_mhz[1]:
            raise ValueError("locked_clocks_mhz is [min, max] with 0 < min <= max")
        return self


def _default_bands() -> list[GpuBand]:
    # H100/H200 start slowing down on their own around 87 C; capping a little earlier keeps the slowdown ours.
    return [
        GpuBand(name="warm", from_c=83, power_limit="85%"),
        GpuBand(name="hot", from_c=88, locked_clocks_mhz=(210, 1200), power_limit="70%"),
    ]


class DvfsGpuConfig(Section):
    enabled: Annotated[bool, RESTART] = True
    bands: list[GpuBand] = Field(default_factory=_default_bands)
    temp_hysteresis_c: float = Field(default=3.0, ge=0, le=20)


class DvfsConfig(Section):
    enabled: Annotated[bool, RESTART] = False
    # Originals are saved only in enforce.
    mode: Annotated[Mode, RESTART] = "dry-run"
    points: list[OperatingPoint] = Field(default_factory=_default_points)
    temp_hysteresis_c: float = Field(default=2.0, ge=0, le=20)
    load_hysteresis_pct: float = Field(default=5.0, ge=0, le=50)
    dwell: Duration = 10.0
    max_writes_per_minute: int = Field(default=6, ge=1, le=600)
    # Time constant of the load average: /proc/stat counts in USER_HZ ticks, so one 100 ms sample is +-10 %.
    load_smoothing: Duration = 1.0
    # scaling_cur_freq can block 10-20 ms per CPU on some drivers: read it per policy, at this cadence.
    freq_read_interval: Duration = 2.0
    # A temperature at or above this (or a sensor's critical trip, whichever is lower) for emergency_readings
    # consecutive ticks goes to the lowest point at once, dwell and write cap notwithstanding.
    emergency_c: float | None = Field(default=None, ge=30, le=150)
    emergency_readings: int = Field(default=3, ge=1, le=100)
    actuator: Annotated[Literal["auto", "scaling_setspeed", "scaling_max_freq", "max_perf_pct"], RESTART] = "auto"
    # A value read back may differ from the one written by this much (drivers round to their P-state steps).
    readback_tolerance_mhz: float = Field(default=100.0, ge=0)
    # Sensors and knobs are found at start.
    thermal_types: Annotated[list[str], RESTART] = Field(default_factory=lambda: [
        "x86_pkg_temp", "cpu-thermal", "cpu_thermal", "acpitz", "soc_thermal", "k10temp"])
    hwmon_names: Annotated[list[str], RESTART] = Field(
        default_factory=lambda: ["coretemp", "k10temp", "zenpower", "cpu_thermal"])
    gpu: DvfsGpuConfig = DvfsGpuConfig()

    @field_validator("points")
    @classmethod
    def _points(cls, v: list[OperatingPoint]) -> list[OperatingPoint]:
        if not v:
            raise ValueError("expected at least one operating point")
        if v[-1].bounded:
            raise ValueError(f"the last point ({v[-1].name!r}) must have no bounds: it is what no other row matches")
        names = [p.name for p in v]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate point names: {sorted(dup)}")
        for p in v:
            for lo, hi, what in ((p.temp_from_c, p.temp_below_c, "temp"), (p.load_from_pct, p.load_below_pct, "load")):
                if lo is not None and hi is not None and lo >= hi:
                    raise ValueError(f"point {p.name!r}: {what}_from must be below {what}_below")
        return v
