"""The one place DVFS writes CPU knobs (cpufreq, intel_pstate): originals saved first (Writer), every result
counted, and a knob that is read-only here or that someone else has since changed turns its policy to monitor only,
never fought over. KnobIO is rollback's access to every kind of knob DVFS turns, GPU ones included."""

from __future__ import annotations

import logging
import math
from typing import Any

from qosagent import cpufreq
from qosagent.dvfs.cpufreq import WriteResult, Writer, freq_writes, same_khz, same_text
from qosagent.dvfs.gpuclocks import GpuIO
from qosagent.dvfs.rollback import Originals
from qosagent.gpu.backend import GpuBackend
from qosagent.hostfs import HostFS

log = logging.getLogger("qosagent.dvfs")

# Write errors that mean "this knob is not ours to turn here": the policy goes to monitor only.
_READ_ONLY = ("EROFS", "EACCES", "EPERM")


class KnobIO:
    """Rollback's access to every kind of knob DVFS turns."""

    def __init__(self, fs: HostFS, gpu: GpuBackend):
        self.fs = fs
        self.gpu = GpuIO(gpu)

    def read(self, key: str) -> str | None:
        if key.startswith("gpu:"):
            return self.gpu.read(key)
        return self.fs.read_text(key.removeprefix("file:"))

    def write(self, key: str, value: str) -> None:
        if key.startswith("gpu:"):
            self.gpu.write(key, value)
        else:
            self.fs.write_text(key.removeprefix("file:"), value)


class CpuFreqActuator:
    def __init__(self, fs: HostFS, originals: Originals, readback_tolerance_mhz: float):
        self.fs = fs
        self.originals = originals
        self.writer = Writer(fs, originals)
        self.readback_tolerance_mhz = readback_tolerance_mhz
        self.notes: dict[str, str] = {}  # policy -> why it is monitor only now
        self.epp_off: dict[str, str] = {}  # policy -> why its EPP is no longer written
        self.writes: dict[str, int] = {}  # results by kind, for metrics
        self._warned: set[str] = set()

    def _count(self, r: WriteResult) -> None:
        key = r.status if r.status != "failed" else f"failed_{r.error}"
        self.writes[key] = self.writes.get(key, 0) + 1

    def write_policy(self, p: cpufreq.Policy, khz: int, epp: str | None) -> None:
        """The policy's frequency cap, then its EPP (the point's, else the original back)."""
        tol = max(int(self.readback_tolerance_mhz * 1000),
                  max((b - a for a, b in zip(p.available, p.available[1:])), default=0))
        same = same_khz(tol)
        for path, value in freq_writes(self.fs, p, khz, self.originals):
            r = self.writer.set(path, value, same)
            self._count(r)
            if not self._settle(p, r, "frequency"):
                return
        if p.epp_prefs and p.name not in self.epp_off:
            path = f"{p.dir}/energy_performance_preference"
            want = epp if epp in p.epp_prefs else self.originals.original(f"file:{path}")
            if want is not None:
                r = self.writer.set(path, want, same_text)
                self._count(r)
                if r.status == "failed" and r.error == "EBUSY":
                    # The performance governor pins EPP; the governor is the operator's, so EPP is off here.
                    self.epp_off[p.name] = "EBUSY (performance governor?)"
                    self._warn_once(f"{p.name}:epp", "%s: energy_performance_preference answers EBUSY; EPP off",
                                    p.name)
                else:
                    self._settle(p, r, "EPP")

    def write_max_perf_pct(self, group: list[cpufreq.Policy], targets: list[tuple[int, int]]) -> None:
        """intel_pstate's one knob for every policy in group: the highest of their targets (kHz, max kHz)."""
        if not targets:
            return
        pct = max(math.ceil(k * 100 / m) for k, m in targets)
        floor = cpufreq.ints(self.fs.try_read(f"{cpufreq.PSTATE}/min_perf_pct"))
        pct = min(100, max(pct, floor[0] if floor else 0))
        r = self.writer.set(f"{cpufreq.PSTATE}/max_perf_pct", str(pct), same_text)
        self._count(r)
        for p in group:
            self._settle(p, r, "max_perf_pct")

    def _settle(self, p: cpufreq.Policy, r: WriteResult, what: str) -> bool:
        """Act on a write result; False when the policy must not be written further now."""
        if r.status in ("written", "same"):
            return True
        if r.status == "mismatch":
            self._warn_once(f"{p.name}:mismatch:{r.path}", "%s: wrote %s to %s, the driver kept %s",
                            p.name, r.want, r.path, r.read_back)
            return True
        if r.status == "foreign":
            # Someone else owns the knob now: never fight them. The policy stays monitored, not actuated.
            self.notes[p.name] = f"yielded: {r.path} changed by someone else (now {r.read_back})"
            log.warning("%s: %s was changed by someone else (now %s); leaving %s alone", p.name, r.path,
                        r.read_back, p.name)
            return False
        if r.error in _READ_ONLY:
            self.notes[p.name] = f"monitor only: {what} not writable ({r.error})"
            log.warning("%s: %s %s: %s; monitoring only", p.name, what, r.path, r.error)
        else:
            self._warn_once(f"{p.name}:{r.error}", "%s: writing %s to %s failed: %s (counted; retried on the next "
                            "change)", p.name, r.want, r.path, r.error)
        return False

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(key)
            log.warning(msg, *args)
