"""GPU bands: from GPU temperature, locked SM clocks and/or a power limit, through the GPU seam.

A band is entered as soon as the GPU is hot enough (protective moves are never delayed) and left only after it
has cooled by the hysteresis and the band has held for the dwell. NotSupported or NoPermission on a knob switches
that knob off for every GPU with one warning; the other knob, the other GPUs and the CPU side keep running.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from qosagent.dvfs.config import GpuBand, parse_power
from qosagent.dvfs.rollback import Originals
from qosagent.gpu.backend import GPU_LOST, NO_PERMISSION, NOT_SUPPORTED, GpuBackend, GpuError, GpuState

log = logging.getLogger("qosagent.dvfs")

UNLOCKED = "unlocked"


def fmt_watts(w: float) -> str:
    return f"{w:.1f}"


def band_for(bands: list[GpuBand], temp: float, current: str | None, hysteresis_c: float) -> str | None:
    """The hottest band temp reaches; the current band is kept until temp is hysteresis_c below its start."""
    by_heat = sorted(bands, key=lambda b: b.from_c)
    want = None
    for b in by_heat:
        if temp >= b.from_c:
            want = b.name
    if current is not None and current != want:
        cur = next((b for b in by_heat if b.name == current), None)
        wanted_from = next((b.from_c for b in by_heat if b.name == want), -math.inf)
        if cur is not None and cur.from_c > wanted_from and temp >= cur.from_c - hysteresis_c:
            return current
    return want


@dataclass
class GpuIO:
    """Reads and writes GPU knobs by rollback key ("gpu:0:power_limit")."""

    backend: GpuBackend

    def read(self, key: str) -> str | None:
        _, index, knob = key.split(":")
        if knob == "power_limit":
            return fmt_watts(self.backend.power_limit(int(index)))
        # NVML reports no locked range: a lock we recorded is taken as still ours, and a reset is then right.
        return None

    def write(self, key: str, value: str) -> None:
        _, index, knob = key.split(":")
        if knob == "power_limit":
            self.backend.set_power_limit(int(index), float(value))
        elif value == UNLOCKED:
            self.backend.reset_locked_clocks(int(index))
        else:
            lo, hi = value.split("-")
            self.backend.set_locked_clocks(int(index), int(lo), int(hi))


@dataclass
class GpuActuator:
    backend: GpuBackend
    originals: Originals
    bands: list[GpuBand]
    hysteresis_c: float
    dwell_s: float
    band: dict[int, str | None] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)
    off: dict[str, str] = field(default_factory=dict)  # knob -> why it is switched off
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> count

    def decide(self, gpus: GpuState, now: float) -> list[tuple[int, str | None, str | None, float]]:
        """(index, old band, new band, temperature) for each GPU whose band changes."""
        out = []
        if not gpus.available:
            return out
        for g in gpus.gpus:
            if g.lost or g.temperature_c is None:
                continue
            cur = self.band.get(g.index)
            new = band_for(self.bands, g.temperature_c, cur, self.hysteresis_c)
            if new == cur:
                continue
            hotter = self._heat(new) > self._heat(cur)
            if not hotter and now - self.since.get(g.index, -math.inf) < self.dwell_s:
                continue
            self.band[g.index] = new
            self.since[g.index] = now
            out.append((g.index, cur, new, g.temperature_c))
        return out

    def _heat(self, name: str | None) -> float:
        return next((b.from_c for b in self.bands if b.name == name), -math.inf)

    def _fail(self, knob: str, index: int, e: GpuError) -> None:
        self.errors[e.kind] = self.errors.get(e.kind, 0) + 1
        if e.kind in (NOT_SUPPORTED, NO_PERMISSION):
            if knob not in self.off:
                log.warning("GPU %s: %s is %s; switched off, the rest of DVFS keeps running", index, knob, e.kind)
            self.off[knob] = f"{e.kind} on GPU {index}"
        elif e.kind != GPU_LOST:
            log.warning("GPU %s: %s failed: %s", index, knob, e)

    def apply(self, index: int, band_name: str | None) -> list[str]:
        """Move GPU index to band_name (None: no band, the originals); returns what was done."""
        band = next((b for b in self.bands if b.name == band_name), None)
        done = []
        if "locked_clocks" not in self.off:
            key = f"gpu:{index}:locked_clocks"
            want = f"{band.locked_clocks_mhz[0]}-{band.locked_clocks_mhz[1]}" if band and band.locked_clocks_mhz \
                else UNLOCKED
            ours = self.originals.entries.get(key)
            if want != UNLOCKED or (ours and ours.ours != [UNLOCKED]):
                try:
                    self.originals.before_write(key, UNLOCKED, want)
                    GpuIO(self.backend).write(key, want)
                    self.originals.after_write(key, want)
                    done.append(f"locked clocks {want}")
                except GpuError as e:
                    self._fail("locked_clocks", index, e)
        if "power_limit" not in self.off:
            key = f"gpu:{index}:power_limit"
            try:
                done += self._power(index, key, band)
            except GpuError as e:
                self._fail("power_limit", index, e)
        return done

    def _power(self, index: int, key: str, band: GpuBand | None) -> list[str]:
        current = fmt_watts(self.backend.power_limit(index))
        if not self.originals.is_ours(key, current):
            log.warning("GPU %s: power limit changed by someone else (now %s W); left alone", index, current)
            return []
        if band is None or band.power_limit is None:
            orig = self.originals.original(key)
            if orig is None or orig == current:
                return []
            want = orig
        else:
            lo, hi = self.backend.power_limit_constraints(index)
            kind, value = parse_power(band.power_limit)
            want = fmt_watts(min(max(value * hi / 100 if kind == "pct" else value, lo), hi))
        if want == current:
            return []
        self.originals.before_write(key, current, want)
        self.backend.set_power_limit(index, float(want))
        self.originals.after_write(key, fmt_watts(self.backend.power_limit(index)))
        return [f"power limit {want} W"]
