"""Temperatures, per-policy load and current frequency, read through HostFS.

Sensors are chosen by what they are (thermal zone type, hwmon chip name), never by index: indexes move between
boots. A bad reading is discarded and counted under its reason; one bad sensor never hides the others.
"""

from __future__ import annotations

import collections
import errno
import math
from dataclasses import dataclass, field

from qosagent.hostfs import HostFS, HostFSError

# thermald#150: some ACPI zones answer this instead of an error when the firmware has no reading.
SENTINEL_MILLI_C = -32768000
# Outside this range a reading is a firmware bug, not a temperature.
PLAUSIBLE_C = (-40.0, 150.0)
# A critical trip below this is a firmware placeholder (ACPI tables with 0 or 20 C exist); taking it would hold the
# host in a thermal emergency forever.
CRITICAL_MIN_C = 40.0


@dataclass(frozen=True)
class Sensor:
    name: str  # stable label: "x86_pkg_temp/thermal_zone2", "coretemp.0/Core 0"
    path: str  # host path of the millidegree file
    critical_c: float | None = None


def _millic(text: str) -> float | None:
    try:
        return int(text.strip()) / 1000.0
    except ValueError:
        return None


def _zone_critical(fs: HostFS, zone: str) -> float | None:
    crit = None
    for t in fs.glob(zone, "trip_point_*_type"):
        if fs.try_read(t) == "critical":
            c = _millic(fs.try_read(t[: -len("_type")] + "_temp") or "")
            if c is not None and CRITICAL_MIN_C <= c < PLAUSIBLE_C[1]:
                crit = c if crit is None else min(crit, c)
    return crit


def discover(fs: HostFS, thermal_types: list[str], hwmon_names: list[str]) -> list[Sensor]:
    out: list[Sensor] = []
    for zone in fs.glob("/sys/class/thermal", "thermal_zone*"):
        kind = fs.try_read(f"{zone}/type")
        if kind in thermal_types:
            out.append(Sensor(f"{kind}/{zone.rsplit('/', 1)[1]}", f"{zone}/temp", _zone_critical(fs, zone)))
    for chip in fs.glob("/sys/class/hwmon", "hwmon*"):
        name = fs.try_read(f"{chip}/name")
        if name not in hwmon_names:
            continue
        # The device's name (coretemp.0, 0000:00:18.3) tells sockets apart and, unlike hwmonN, survives a reboot.
        device = fs.realpath(f"{chip}/device").rsplit("/", 1)[1] if fs.exists(f"{chip}/device") else ""
        owner = device or chip.rsplit("/", 1)[1]
        for inp in fs.glob(chip, "temp*_input"):
            stem = inp[: -len("_input")]
            label = fs.try_read(f"{stem}_label") or stem.rsplit("/", 1)[1]
            crit = _millic(fs.try_read(f"{stem}_crit") or "")
            plausible = crit is not None and CRITICAL_MIN_C <= crit < PLAUSIBLE_C[1]
            out.append(Sensor(f"{name}:{owner}/{label}", inp, crit if plausible else None))
    return out


def read_celsius(fs: HostFS, sensor: Sensor) -> tuple[float | None, str | None]:
    """(degrees, None) or (None, why it was discarded)."""
    try:
        text = fs.read_text(sensor.path)
    except HostFSError as e:
        return None, errno.errorcode.get(e.errno or 0, "EIO")
    try:
        milli = int(text)
    except ValueError:
        return None, "unparsable"
    if milli == SENTINEL_MILLI_C:
        return None, "sentinel"
    c = milli / 1000.0
    if not PLAUSIBLE_C[0] < c < PLAUSIBLE_C[1]:
        return None, "absurd"
    return c, None


@dataclass
class SensorReader:
    fs: HostFS
    sensors: list[Sensor]
    bad: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    def read(self) -> dict[str, float]:
        temps: dict[str, float] = {}
        for s in self.sensors:
            value, why = read_celsius(self.fs, s)
            if why is not None:
                self.bad[(s.name, why)] += 1
            else:
                temps[s.name] = value  # type: ignore[assignment]
        return temps


def parse_proc_stat(text: str) -> dict[int, tuple[int, int]]:
    """Per CPU (busy, total) jiffies. iowait counts as idle: a CPU waiting on I/O needs no frequency."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        parts = line.split()
        try:
            cpu = int(parts[0][3:])
            vals = [int(x) for x in parts[1:]]
        except ValueError:
            continue
        if len(vals) < 4:
            continue
        # guest and guest_nice (fields 9, 10) are already inside user and nice.
        total = sum(vals[:8])
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        out[cpu] = (total - idle, total)
    return out


@dataclass
class LoadTracker:
    """Smoothed busy fraction per group of CPUs (a cpufreq policy) from /proc/stat deltas.

    USER_HZ quantizes a 100 ms sample to ~10 jiffies per CPU, so one sample is noise of +-10 %; an exponential
    average with a time constant (not a fixed weight) stays right when ticks come late."""

    tau_s: float
    groups: dict[str, tuple[int, ...]]
    _last: dict[int, tuple[int, int]] = field(default_factory=dict)
    _last_t: float | None = None
    load: dict[str, float] = field(default_factory=dict)  # 0..1

    def update(self, now: float, stat: dict[int, tuple[int, int]]) -> dict[str, float]:
        if self._last_t is not None and self._last:
            dt = max(now - self._last_t, 0.0)
            alpha = 1.0 if self.tau_s <= 0 else 1.0 - math.exp(-dt / self.tau_s)
            for name, cpus in self.groups.items():
                busy = total = 0
                for c in cpus:
                    if c in stat and c in self._last:
                        db, dt_ = stat[c][0] - self._last[c][0], stat[c][1] - self._last[c][1]
                        if dt_ > 0 and 0 <= db <= dt_:  # counters that went back (CPU hotplug) are skipped
                            busy += db
                            total += dt_
                if total == 0:
                    continue
                sample = busy / total
                prev = self.load.get(name)
                self.load[name] = sample if prev is None else prev + alpha * (sample - prev)
        self._last = stat
        self._last_t = now
        return dict(self.load)
