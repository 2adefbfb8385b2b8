"""DVFS: CPU frequency (and GPU clocks/power) from temperature and load, with hysteresis, bounds and rollback.

collect reads sensors, load and (at a slower cadence) current frequency; decide runs the pure operating-point
step per cpufreq policy and the GPU bands; apply writes through Writer (originals saved and persisted first);
stop restores in reverse. In dry-run nothing is written and nothing needs restoring.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from qosagent.admission.model import AdmissionPart
from qosagent.capability import AgentContext, Capability, CapabilityError, Change, State, Verdict
from qosagent.dvfs import cpufreq, policy, sensors
from qosagent.dvfs.config import DvfsConfig, parse_freq
from qosagent.dvfs.gpuclocks import GpuActuator, GpuIO
from qosagent.dvfs.rollback import Originals
from qosagent.gpu.backend import GpuBackend, GpuError, GpuState, NoGpu
from qosagent.hostfs import HostFS
from qosagent.schedule import Every
from qosagent.snapshot import Decision, Snapshot

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features

log = logging.getLogger("qosagent.dvfs")

# Write errors that mean "this knob is not ours to turn here": the policy goes to monitor only.
_READ_ONLY = ("EROFS", "EACCES", "EPERM")


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


def _params(cfg: DvfsConfig, p: cpufreq.Policy) -> policy.Params | None:
    khz = {}
    for pt in cfg.points:
        k = cpufreq.resolve_khz(p, *parse_freq(pt.freq))
        if k is None:
            return None
        khz[pt.name] = k
    return policy.Params(tuple(cfg.points), khz, cfg.temp_hysteresis_c, cfg.load_hysteresis_pct / 100, cfg.dwell,
                         cfg.max_writes_per_minute, cfg.emergency_readings)


class Dvfs(Capability):
    name = "dvfs"

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.cfg: DvfsConfig = ctx.config.dvfs
        self.enforce = self.cfg.mode == "enforce"
        self.originals = Originals(ctx.config.state_dir if self.enforce else None, str(ctx.hostfs.root))
        self.writer = cpufreq.Writer(ctx.hostfs, self.originals)
        self.policies: list[cpufreq.Policy] = []
        self.params: dict[str, policy.Params] = {}
        self.states: dict[str, policy.State] = {}
        self.notes: dict[str, str] = {}  # policy -> why it is monitor only now
        self.epp_off: dict[str, str] = {}  # policy -> why its EPP is no longer written
        self.reader = sensors.SensorReader(ctx.hostfs, [])
        self.loads: sensors.LoadTracker | None = None
        self.cur_khz: dict[str, int] = {}
        self._freq_read = Every(self.cfg.freq_read_interval)
        self.critical_c: float | None = None
        self.writes: dict[str, int] = {}
        self.gpu: GpuActuator | None = None
        self._warned: set[str] = set()

    # ---- probe / start / stop ----------------------------------------------------------------------------
    def probe(self, features: "Features") -> Verdict:
        fs = self.ctx.hostfs
        found = sensors.discover(fs, self.cfg.thermal_types, self.cfg.hwmon_names)
        pols = cpufreq.discover(fs, self.cfg.actuator)
        acting = [p for p in pols if p.actuator]
        gpus = self._gpu_devices()
        if not found and not acting:
            cpu_why = ("no cpufreq policy with a frequency knob and no temperature sensor "
                       f"of types {self.cfg.thermal_types} or chips {self.cfg.hwmon_names}")
            if not gpus:
                return Verdict(State.UNAVAILABLE, cpu_why)
            # A GPU VM often has no cpufreq and no CPU sensors: the GPU bands still run on NVML's readings.
            return Verdict(State.DEGRADED, f"{self.cfg.mode}; {len(gpus)} GPU(s) only; CPU: {cpu_why}")
        parts = [self.cfg.mode]
        if acting:
            kinds = sorted({f"{p.actuator} ({p.driver})" for p in acting})
            parts.append(f"{len(acting)}/{len(pols)} policies via {', '.join(kinds)}")
        if not found:
            return Verdict(State.DEGRADED, "; ".join(parts + ["no temperature sensor: frequency is left alone"]))
        if not acting:
            why = pols[0].why if pols else "no cpufreq"
            return Verdict(State.DEGRADED, "; ".join(parts + [f"{why}: monitoring temperatures only"]))
        return Verdict(State.ACTIVE, "; ".join(parts + [f"{len(found)} sensors"]))

    def _gpu_devices(self) -> list[Any]:
        gpu = self.ctx.gpu
        if not (self.cfg.gpu.enabled and self.cfg.gpu.bands) or isinstance(gpu, NoGpu):
            return []
        return gpu.devices()

    def start(self) -> None:
        fs = self.ctx.hostfs
        if self.enforce:
            self._recover()
        self.reader = sensors.SensorReader(fs, sensors.discover(fs, self.cfg.thermal_types, self.cfg.hwmon_names))
        crits = [c for c in (*(s.critical_c for s in self.reader.sensors), self.cfg.emergency_c) if c is not None]
        self.critical_c = min(crits) if crits else None
        self.policies = cpufreq.discover(fs, self.cfg.actuator)
        for p in self.policies:
            params = _params(self.cfg, p) if p.actuator else None
            if params is None:
                self.notes[p.name] = p.why if not p.actuator else "cpuinfo_max_freq unknown: relative points unusable"
                continue
            self.params[p.name] = params
            self.states[p.name] = policy.State()
        self.loads = sensors.LoadTracker(self.cfg.load_smoothing, {p.name: p.cpus for p in self.policies})
        gpu = self.ctx.gpu
        if self._gpu_devices():
            self.gpu = GpuActuator(gpu, self.originals, list(self.cfg.gpu.bands), self.cfg.gpu.temp_hysteresis_c,
                                   self.cfg.dwell)

    def _recover(self) -> None:
        """A previous agent died with our values in place: put the host back before starting over."""
        state_dir = self.ctx.config.state_dir
        try:
            os.makedirs(state_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise CapabilityError(
                f"state_dir {state_dir}: {e.strerror}; originals must be saved before any write") from None
        if not os.access(state_dir, os.W_OK):
            raise CapabilityError(f"state_dir {state_dir} is not writable; originals must be saved before any write")
        try:
            left = Originals.load(self.ctx.config.state_dir, str(self.ctx.hostfs.root))
        except ValueError as e:
            raise CapabilityError(f"{e}; move it away (or run `qosagent detach`) before enforcing") from None
        if left:
            for line in left.restore(KnobIO(self.ctx.hostfs, self.ctx.gpu)):
                log.warning("recovering after an unclean stop: %s", line.removeprefix("dvfs: "))
            if left:
                raise CapabilityError("originals left by a previous agent could not all be restored; "
                                      f"see {left.path}")

    def stop(self) -> None:
        for line in self.restore():
            log.info("%s", line.removeprefix("dvfs: "))

    def restore(self) -> list[str]:
        """Originals back in reverse write order; harmless when there is nothing (left) to restore."""
        if not self.originals:
            return []
        return self.originals.restore(KnobIO(self.ctx.hostfs, self.ctx.gpu))

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        try:
            left = Originals.load(ctx.config.state_dir, str(ctx.hostfs.root))
        except ValueError as e:
            return [f"dvfs: {e}"]
        if not left:
            return []
        gpu = ctx.gpu
        if any(k.startswith("gpu:") for k in left.entries) and isinstance(gpu, NoGpu):
            from qosagent.gpu.backend import make_backend

            try:
                gpu = make_backend(ctx.config.gpu.backend, ctx.config.gpu.fake_file)
            except GpuError as e:
                log.warning("no GPU backend for restoring GPU knobs: %s", e)
        try:
            return left.restore(KnobIO(ctx.hostfs, gpu))
        finally:
            if gpu is not ctx.gpu:
                gpu.close()

    def prepare(self, config: "Config") -> Change:
        new = config.dvfs
        params = {}
        for p in self.policies:
            if p.name in self.params:
                pr = _params(new, p)
                if pr is None:
                    raise CapabilityError(f"{p.name}: relative points need cpuinfo_max_freq, which is unknown")
                params[p.name] = pr
        # A point that is gone or now means another frequency is forgotten: the next tick picks from the new table
        # without waiting for a dwell, so what is written always matches what status shows.
        states = {name: (policy.State(transitions=st.transitions)
                         if st.point is not None and params[name].khz.get(st.point) != self.params[name].khz[st.point]
                         else st) for name, st in self.states.items()}
        crits = [c for c in (*(s.critical_c for s in self.reader.sensors), new.emergency_c) if c is not None]
        old = _Tables(self.cfg, self.params, self.states, self.critical_c)
        return Change(lambda: self._take(_Tables(new, params, states, min(crits) if crits else None)),
                      lambda: self._take(old))

    def _take(self, t: "_Tables") -> None:
        self.cfg, self.params, self.states, self.critical_c = t.cfg, t.params, dict(t.states), t.critical_c
        self._freq_read.period = t.cfg.freq_read_interval
        if self.gpu:
            self.gpu.bands = list(t.cfg.gpu.bands)
            self.gpu.hysteresis_c = t.cfg.gpu.temp_hysteresis_c
            self.gpu.dwell_s = t.cfg.dwell

    # ---- the tick ----------------------------------------------------------------------------------------
    def collect(self) -> DvfsPart:
        fs = self.ctx.hostfs
        now = self.ctx.clock()
        temps = self.reader.read()
        loads: dict[str, float] = {}
        if self.loads is not None:
            text = fs.try_read("/proc/stat")
            if text is not None:
                loads = self.loads.update(now, sensors.parse_proc_stat(text))
        if self._freq_read.due(now):
            for p in self.policies:
                v = cpufreq.ints(fs.try_read(f"{p.dir}/scaling_cur_freq"))
                if v:
                    self.cur_khz[p.name] = v[0]
                else:
                    self.cur_khz.pop(p.name, None)
        views = []
        for p in self.policies:
            st = self.states.get(p.name)
            pr = self.params.get(p.name)
            views.append(PolicyView(
                p.name, p.cpus, p.driver, p.governor, p.actuator if p.name in self.params else None,
                st.point if st else None, pr.khz.get(st.point) if st and pr and st.point else None,
                self.cur_khz.get(p.name), loads.get(p.name), st.transitions if st else 0, st.kind if st else "",
                st.reason if st else "", st.held if st else "",
                self.notes.get(p.name) or (f"EPP off: {self.epp_off[p.name]}" if p.name in self.epp_off else "")))
        return DvfsPart(
            mode=self.cfg.mode,
            temperatures=MappingProxyType(temps),
            hottest_c=max(temps.values()) if temps else None,
            critical_c=self.critical_c,
            emergency=any(s.emergency for s in self.states.values()),
            policies=tuple(views),
            gpu_bands=MappingProxyType(dict(self.gpu.band) if self.gpu else {}),
            gpu_off=MappingProxyType(dict(self.gpu.off) if self.gpu else {}),
            bad_readings=MappingProxyType(dict(self.reader.bad)),
            writes=MappingProxyType(dict(self.writes)),
        )

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        part: DvfsPart | None = snapshot.part(self.name)
        if part is None:
            return []
        adm = snapshot.part("admission")
        near = adm.near_slo if isinstance(adm, AdmissionPart) else frozenset()
        now = snapshot.monotonic
        out = []
        for view in part.policies:
            if view.name not in self.params or view.name in self.notes:
                continue
            pr = self.params[view.name]
            inp = policy.Inputs(part.hottest_c, view.load, part.critical_c, near)
            step = policy.step(pr, self.states[view.name], inp, now)
            self.states[view.name] = step.state
            if step.changed:
                st = step.state
                out.append(Decision(self.name, view.name, "set_freq", step.old, st.point, st.reason,
                                    {"kind": st.kind, "temp_c": part.hottest_c, "load": view.load,
                                     "near_slo": sorted(near), "target_khz": pr.khz[st.point]},
                                    applied=self.enforce, command=SetFreq(view.name, pr.khz[st.point], st.point)))
        gpus = snapshot.part("gpu")
        if self.gpu and isinstance(gpus, GpuState):
            for index, old, new, temp in self.gpu.decide(gpus, now):
                out.append(Decision(self.name, f"gpu{index}", "gpu_band", old or "none", new or "none",
                                    f"GPU {index} at {temp:.0f} C", {"temp_c": temp}, applied=self.enforce,
                                    command=GpuBandChange(index, new)))
        return out

    def apply(self, decisions: list[Decision]) -> None:
        if not self.enforce:
            return
        pstate = False
        for d in decisions:
            c = d.command
            if isinstance(c, GpuBandChange) and self.gpu:
                self.gpu.apply(c.gpu, c.band)
                continue
            if not isinstance(c, SetFreq) or c.policy in self.notes:
                continue
            p = next(p for p in self.policies if p.name == c.policy)
            if p.actuator == "max_perf_pct":
                pstate = True
                continue
            self._write_policy(p, c.khz, c.point)
        if pstate:
            self._write_max_perf_pct()

    # ---- writes ------------------------------------------------------------------------------------------
    def _count(self, r: cpufreq.WriteResult) -> None:
        key = r.status if r.status != "failed" else f"failed_{r.error}"
        self.writes[key] = self.writes.get(key, 0) + 1

    def _write_policy(self, p: cpufreq.Policy, khz: int, point: str) -> None:
        tol = max(int(self.cfg.readback_tolerance_mhz * 1000),
                  max((b - a for a, b in zip(p.available, p.available[1:])), default=0))
        same = cpufreq.same_khz(tol)
        for path, value in cpufreq.freq_writes(self.ctx.hostfs, p, khz, self.originals):
            r = self.writer.set(path, value, same)
            self._count(r)
            if not self._settle(p, r, "frequency"):
                return
        epp = self.params[p.name].point(point).epp
        if p.epp_prefs and p.name not in self.epp_off:
            path = f"{p.dir}/energy_performance_preference"
            want = epp if epp in p.epp_prefs else self.originals.original(f"file:{path}")
            if want is not None:
                r = self.writer.set(path, want, cpufreq.same_text)
                self._count(r)
                if r.status == "failed" and r.error == "EBUSY":
                    # The performance governor pins EPP; the governor is the operator's, so EPP is off here.
                    self.epp_off[p.name] = "EBUSY (performance governor?)"
                    self._warn_once(f"{p.name}:epp", "%s: energy_performance_preference answers EBUSY; EPP off",
                                    p.name)
                else:
                    self._settle(p, r, "EPP")

    def _write_max_perf_pct(self) -> None:
        group = [p for p in self.policies if p.actuator == "max_perf_pct" and p.name in self.params
                 and p.name not in self.notes]
        targets = [(self.params[p.name].khz[self.states[p.name].point], p.max_khz) for p in group
                   if self.states[p.name].point and p.max_khz]
        if not targets:
            return
        pct = max(math.ceil(k * 100 / m) for k, m in targets)
        floor = cpufreq.ints(self.ctx.hostfs.try_read(f"{cpufreq.PSTATE}/min_perf_pct"))
        pct = min(100, max(pct, floor[0] if floor else 0))
        r = self.writer.set(f"{cpufreq.PSTATE}/max_perf_pct", str(pct), cpufreq.same_text)
        self._count(r)
        for p in group:
            self._settle(p, r, "max_perf_pct")

    def _settle(self, p: cpufreq.Policy, r: cpufreq.WriteResult, what: str) -> bool:
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

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot) -> Iterable["Metric"]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        part: DvfsPart | None = snapshot.part(self.name)
        if part is None:
            return
        temp = GaugeMetricFamily("qosagent_dvfs_temperature_celsius", "Temperature per sensor (valid readings)",
                                 labels=["sensor"])
        for s, v in sorted(part.temperatures.items()):
            temp.add_metric([s], v)
        yield temp
        bad = CounterMetricFamily("qosagent_dvfs_bad_readings", "Sensor readings discarded, by reason",
                                  labels=["sensor", "reason"])
        for (s, why), n in sorted(part.bad_readings.items()):
            bad.add_metric([s, why], n)
        yield bad
        yield GaugeMetricFamily("qosagent_dvfs_emergency", "1 while a thermal emergency holds the lowest point",
                                value=1.0 if part.emergency else 0.0)
        load = GaugeMetricFamily("qosagent_dvfs_load_ratio", "Smoothed busy fraction of the policy's CPUs",
                                 labels=["policy"])
        target = GaugeMetricFamily("qosagent_dvfs_target_frequency_hertz", "Frequency of the operating point",
                                   labels=["policy"])
        cur = GaugeMetricFamily("qosagent_dvfs_current_frequency_hertz", "scaling_cur_freq, read per policy",
                                labels=["policy"])
        point = GaugeMetricFamily("qosagent_dvfs_operating_point", "1 for the policy's operating point",
                                  labels=["policy", "point"])
        trans = CounterMetricFamily("qosagent_dvfs_transitions", "Operating-point changes", labels=["policy"])
        last = GaugeMetricFamily("qosagent_dvfs_last_change_info", "What caused the policy's last change",
                                 labels=["policy", "kind"])
        for v in part.policies:
            if v.load is not None:
                load.add_metric([v.name], v.load)
            if v.target_khz is not None:
                target.add_metric([v.name], v.target_khz * 1000.0)
            if v.cur_khz is not None:
                cur.add_metric([v.name], v.cur_khz * 1000.0)
            if v.point:
                point.add_metric([v.name, v.point], 1.0)
                trans.add_metric([v.name], v.transitions)
                last.add_metric([v.name, v.kind], 1.0)
        yield from (load, target, cur, point, trans, last)
        writes = CounterMetricFamily("qosagent_dvfs_writes", "Knob writes by result (same: skipped, value there)",
                                     labels=["result"])
        for k, n in sorted(part.writes.items()):
            writes.add_metric([k], n)
        yield writes
        gpus = snapshot.part("gpu")
        if isinstance(gpus, GpuState) and gpus.available:
            fams = {
                "temperature_c": GaugeMetricFamily("qosagent_dvfs_gpu_temperature_celsius", "GPU temperature",
                                                   labels=["gpu"]),
                "power_w": GaugeMetricFamily("qosagent_dvfs_gpu_power_watts", "GPU power draw", labels=["gpu"]),
                "power_limit_w": GaugeMetricFamily("qosagent_dvfs_gpu_power_limit_watts", "Enforced power limit",
                                                   labels=["gpu"]),
                "sm_clock_mhz": GaugeMetricFamily("qosagent_dvfs_gpu_sm_clock_hertz", "SM clock", labels=["gpu"]),
                "mem_clock_mhz": GaugeMetricFamily("qosagent_dvfs_gpu_memory_clock_hertz", "Memory clock",
                                                   labels=["gpu"]),
                "clock_event_reasons": GaugeMetricFamily("qosagent_dvfs_gpu_clock_event_reasons",
                                                         "NVML clock event reasons bitmask", labels=["gpu"]),
            }
            for g in gpus.gpus:
                for attr, fam in fams.items():
                    val = getattr(g, attr)
                    if val is not None:
                        fam.add_metric([str(g.index)], val * (1e6 if attr.endswith("_mhz") else 1.0))
            yield from fams.values()
            band = GaugeMetricFamily("qosagent_dvfs_gpu_band", "1 for the GPU's band (none: no band)",
                                     labels=["gpu", "band"])
            for i, b in sorted(part.gpu_bands.items()):
                band.add_metric([str(i), b or "none"], 1.0)
            yield band

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part: DvfsPart | None = snapshot.part(self.name)
        if part is None:
            return {}
        gpus = snapshot.part("gpu")
        gpu_rows = []
        if isinstance(gpus, GpuState) and gpus.available:
            for g in gpus.gpus:
                gpu_rows.append({"gpu": g.index, "temp_c": g.temperature_c, "power_w": g.power_w,
                                 "power_limit_w": g.power_limit_w, "sm_clock_mhz": g.sm_clock_mhz,
                                 "mem_clock_mhz": g.mem_clock_mhz, "clock_event_reasons": g.clock_event_reasons,
                                 "band": part.gpu_bands.get(g.index)})
        return {
            "mode": part.mode,
            "temperatures": dict(part.temperatures),
            "hottest_c": part.hottest_c,
            "critical_c": part.critical_c,
            "emergency": part.emergency,
            "policies": [{
                "policy": v.name, "cpus": list(v.cpus), "driver": v.driver, "governor": v.governor,
                "actuator": v.actuator, "point": v.point, "target_mhz": v.target_khz // 1000 if v.target_khz else None,
                "cur_mhz": v.cur_khz // 1000 if v.cur_khz else None, "load": v.load, "transitions": v.transitions,
                "kind": v.kind, "reason": v.reason, "held": v.held, "note": v.note,
            } for v in part.policies],
            "gpus": gpu_rows,
            "gpu_off": dict(part.gpu_off),
            "bad_readings": {f"{s}:{why}": n for (s, why), n in part.bad_readings.items()},
            "writes": dict(part.writes),
        }

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        def num(v: Any, fmt: str = "{:.0f}") -> str:
            return "-" if v is None else fmt.format(v)

        temps = ", ".join(f"{k} {v:.1f}" for k, v in sorted(status.get("temperatures", {}).items())) or "none valid"
        lines = [f"DVFS ({status.get('mode')})  hottest {num(status.get('hottest_c'), '{:.1f}')} C  critical "
                 f"{num(status.get('critical_c'), '{:.1f}')} C{'  EMERGENCY' if status.get('emergency') else ''}",
                 f"temperatures C: {temps}"]
        if status.get("policies"):
            lines.append(f"{'POLICY':<10} {'CPUS':<8} {'DRIVER/GOVERNOR':<28} {'ACTUATOR':<17} {'POINT':<10} "
                         f"{'TARGET_MHZ':>10} {'CUR_MHZ':>8} {'LOAD':>5} {'TRANS':>5}  LAST CHANGE")
            for p in status["policies"]:
                cpus = ",".join(map(str, p["cpus"]))
                last = p["reason"] or "-"
                if p.get("held"):
                    last += f" [held: {p['held']}]"
                if p.get("note"):
                    last += f" [{p['note']}]"
                lines.append(f"{p['policy']:<10} {cpus[:8]:<8} {p['driver'] + '/' + p['governor']:<28} "
                             f"{p['actuator'] or 'none':<17} {p['point'] or '-':<10} {num(p['target_mhz']):>10} "
                             f"{num(p['cur_mhz']):>8} {num(p['load'], '{:.0%}'):>5} {p['transitions']:>5}  {last}")
        else:
            lines.append("no cpufreq policies: monitoring temperatures only")
        for g in status.get("gpus", []):
            lines.append(f"gpu{g['gpu']}: {num(g['temp_c'])} C  {num(g['power_w'])}/{num(g['power_limit_w'])} W  "
                         f"SM {num(g['sm_clock_mhz'])} MHz  mem {num(g['mem_clock_mhz'])} MHz  "
                         f"reasons {num(g['clock_event_reasons'], '{:#x}')}  band {g['band'] or 'none'}")
        for knob, why in status.get("gpu_off", {}).items():
            lines.append(f"gpu {knob}: off ({why})")
        bad = status.get("bad_readings") or {}
        if bad:
            lines.append("discarded readings: " + ", ".join(f"{k} x{n}" for k, n in sorted(bad.items())))
        return "\n".join(lines)


@dataclass(frozen=True)
class _Tables:
    """What a config makes of the decision tables: kept for the one in force, so a reload can be undone."""

    cfg: DvfsConfig
    params: dict[str, policy.Params]
    states: dict[str, policy.State]
    critical_c: float | None


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
