"""DVFS: CPU frequency (and GPU clocks/power) from temperature and load, with hysteresis, bounds and rollback.

collect reads sensors, load and (at a slower cadence) current frequency; decide runs the pure operating-point
step per cpufreq policy and the GPU bands; apply hands each decision's command to the CPU actuator
(qosagent/dvfs/actuator.py: originals saved and persisted first) or the GPU one (gpuclocks.py); stop restores in
reverse. In dry-run nothing is written and nothing needs restoring. The part and commands are in model.py, what
is shown of them in export.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Container, Iterable

from qosagent import cpufreq
from qosagent.admission.model import ADMISSION
from qosagent.capability import AgentContext, Capability, CapabilityError, Change, State, Verdict, rewrite
from qosagent.retention import EVERYONE
from qosagent import sandbox
from qosagent.sandbox import Need
from qosagent.dvfs import export, policy, rollback, sensors
from qosagent.dvfs.actuator import CpuFreqActuator, KnobIO
from qosagent.dvfs.config import DvfsConfig, parse_freq
from qosagent.dvfs.cpufreq import resolve_khz
from qosagent.dvfs.gpuclocks import GpuActuator
from qosagent.dvfs.model import DVFS, DvfsPart, GpuBandChange, PolicyView, SetFreq
from qosagent.dvfs.rollback import Originals
from qosagent.gpu.backend import GPU, GpuError, NoGpu
from qosagent.gpu.choose import make_backend
from qosagent.latency.model import LATENCY
from qosagent.schedule import Every
from qosagent.snapshot import Decision, Snapshot

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features

log = logging.getLogger("qosagent.dvfs")

# Write errors that mean "this knob is not ours to turn here": the policy goes to monitor only.
_READ_ONLY = ("EROFS", "EACCES", "EPERM")


def _params(cfg: DvfsConfig, p: cpufreq.Policy) -> policy.Params | None:
    khz = {}
    for pt in cfg.points:
        k = resolve_khz(p, *parse_freq(pt.freq))
        if k is None:
            return None
        khz[pt.name] = k
    return policy.Params(tuple(cfg.points), khz, cfg.temp_hysteresis_c, cfg.load_hysteresis_pct / 100, cfg.dwell,
                         cfg.max_writes_per_minute, cfg.emergency_readings)


class Dvfs(Capability):
    name = "dvfs"

    @classmethod
    def sandbox_needs(cls, config: "Config") -> list[Need]:
        if config.dvfs.mode != "enforce":
            return []
        return ([Need("ReadWritePaths", p, "CPU frequency limits", host=True) for p in sandbox.CPUFREQ]
                + sandbox.state_dir(config))

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.cfg: DvfsConfig = ctx.config.dvfs
        self.enforce = self.cfg.mode == "enforce"
        self.originals = Originals(ctx.config.state_dir if self.enforce else None, str(ctx.hostfs.root))
        self.cpu = CpuFreqActuator(ctx.hostfs, self.originals, self.cfg.readback_tolerance_mhz)
        self.policies: list[cpufreq.Policy] = []
        self.params: dict[str, policy.Params] = {}
        self.states: dict[str, policy.State] = {}
        self.reader = sensors.SensorReader(ctx.hostfs, [])
        self.loads: sensors.LoadTracker | None = None
        self.cur_khz: dict[str, int] = {}
        self._freq_read = Every(self.cfg.freq_read_interval)
        self.critical_c: float | None = None
        self.gpu: GpuActuator | None = None

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
            # A GPU VM often has no cpufreq and no CPU sensors: the GPU bands still run on NVML's readings, and the
            # CPU side has nothing to act on (the host's circumstance, not a fault).
            return Verdict(State.ACTIVE, f"{self.cfg.mode}; {len(gpus)} GPU(s) only; CPU: {cpu_why}")
        parts = [self.cfg.mode]
        if acting:
            kinds = sorted({f"{p.actuator} ({p.driver})" for p in acting})
            parts.append(f"{len(acting)}/{len(pols)} policies via {', '.join(kinds)}")
        # With nothing to steer by or nothing to steer, dvfs idles, unless the operator named an actuator this host
        # lacks: that is what was asked for and did not work.
        asked = State.DEGRADED if self.cfg.actuator != "auto" else State.IDLE
        if not found:
            return Verdict(asked, "; ".join(parts + ["no temperature sensor: frequency is left alone"]))
        if not acting:
            why = pols[0].why if pols else "no cpufreq"
            return Verdict(asked, "; ".join(parts + [f"{why}: monitoring temperatures only"]))
        return Verdict(State.ACTIVE, "; ".join(parts + [f"{len(found)} sensors"]))

    def _gpu_devices(self) -> list[Any]:
        gpu = self.ctx.gpu
        if not (self.cfg.gpu.enabled and self.cfg.gpu.bands) or isinstance(gpu, NoGpu):
            return []
        return gpu.devices()

    def start(self, plan: None = None) -> None:
        fs = self.ctx.hostfs
        if self.enforce:
            rollback.recover(self.ctx.config.state_dir, str(fs.root), KnobIO(fs, self.ctx.gpu))
        self.reader = sensors.SensorReader(fs, sensors.discover(fs, self.cfg.thermal_types, self.cfg.hwmon_names))
        crits = [c for c in (*(s.critical_c for s in self.reader.sensors), self.cfg.emergency_c) if c is not None]
        self.critical_c = min(crits) if crits else None
        self.policies = cpufreq.discover(fs, self.cfg.actuator)
        for p in self.policies:
            params = _params(self.cfg, p) if p.actuator else None
            if params is None:
                self.cpu.notes[p.name] = (p.why if not p.actuator
                                          else "cpuinfo_max_freq unknown: relative points unusable")
                continue
            self.params[p.name] = params
            self.states[p.name] = policy.State()
        self.loads = sensors.LoadTracker(self.cfg.load_smoothing, {p.name: p.cpus for p in self.policies})
        gpu = self.ctx.gpu
        if self._gpu_devices():
            self.gpu = GpuActuator(gpu, self.originals, list(self.cfg.gpu.bands), self.cfg.gpu.temp_hysteresis_c,
                                   self.cfg.dwell)

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
        return rewrite(self._take, _Tables(new, params, states, min(crits) if crits else None), old, "DVFS tables")

    def _take(self, t: "_Tables") -> None:
        self.cfg, self.params, self.states, self.critical_c = t.cfg, t.params, dict(t.states), t.critical_c
        self.cpu.readback_tolerance_mhz = t.cfg.readback_tolerance_mhz
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
                self.cpu.notes.get(p.name)
                or (f"EPP off: {self.cpu.epp_off[p.name]}" if p.name in self.cpu.epp_off else "")))
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
            writes=MappingProxyType(dict(self.cpu.writes)),
        )

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        part = snapshot.part(DVFS)
        if part is None:
            return []
        # This tick's SLO verdict, as latency's collect judged it (not admission's part of the tick before), held to
        # while admission runs: the tiers near their SLO.
        lat = snapshot.part(LATENCY)
        verdict = lat.verdict if lat is not None and snapshot.part(ADMISSION) is not None else None
        near = verdict.near_slo if verdict is not None else frozenset()
        now = snapshot.monotonic
        out = []
        for view in part.policies:
            if view.name not in self.params or view.name in self.cpu.notes:
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
        gpus = snapshot.part(GPU)
        if self.gpu and gpus is not None:
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
            if not isinstance(c, SetFreq) or c.policy in self.cpu.notes:
                continue
            p = next(p for p in self.policies if p.name == c.policy)
            if p.actuator == "max_perf_pct":
                pstate = True
                continue
            self.cpu.write_policy(p, c.khz, self.params[p.name].point(c.point).epp)
        if pstate:
            group = [p for p in self.policies if p.actuator == "max_perf_pct" and p.name in self.params
                     and p.name not in self.cpu.notes]
            self.cpu.write_max_perf_pct(group, [(self.params[p.name].khz[self.states[p.name].point], p.max_khz)
                                                for p in group if self.states[p.name].point and p.max_khz])

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(DVFS)
        return export.metrics(part, snapshot.part(GPU)) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(DVFS)
        return export.status(part, snapshot.part(GPU)) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)


@dataclass(frozen=True)
class _Tables:
    """What a config makes of the decision tables: kept for the one in force, so a reload can be undone."""

    cfg: DvfsConfig
    params: dict[str, policy.Params]
    states: dict[str, policy.State]
    critical_c: float | None
