"""What DVFS shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the Snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client.core import Metric

from qosagent.dvfs.model import DvfsPart, PolicyView
from qosagent.exposition import Family, Series, families, one
from qosagent.gpu.backend import GpuSample, GpuState


@dataclass(frozen=True)
class Source:
    """What DVFS's families are read from: its part and the tick's GPU sample (clocks, power, temperature)."""

    part: DvfsPart
    gpus: GpuState | None

    @property
    def gpus_known(self) -> bool:
        return self.gpus is not None and self.gpus.available


def _policies(row: Callable[[PolicyView], tuple[list[str], float] | None]) -> Callable[[Source], Series]:
    """A family with a series per policy that has one (row: None where the policy has no value)."""
    return lambda s: (r for v in s.part.policies if (r := row(v)) is not None)


def _gpus(attr: str, scale: float = 1.0) -> Callable[[Source], Series]:
    """A family with a series per GPU reading attr (valid readings only), times scale (MHz to Hz)."""
    def series(s: Source) -> Series:
        samples: tuple[GpuSample, ...] = s.gpus.gpus if s.gpus is not None else ()
        return (([str(g.index)], val * scale) for g in samples if (val := getattr(g, attr)) is not None)
    return series


def _gpu_family(name: str, help_: str, attr: str, scale: float = 1.0) -> Family[Source]:
    return Family(name, "gauge", help_, ("gpu",), _gpus(attr, scale), shown=lambda s: s.gpus_known)


FAMILIES: tuple[Family[Source], ...] = (
    Family("qosagent_dvfs_temperature_celsius", "gauge", "Temperature per sensor (valid readings)", ("sensor",),
           lambda s: (([k], v) for k, v in sorted(s.part.temperatures.items()))),
    Family("qosagent_dvfs_bad_readings", "counter", "Sensor readings discarded, by reason", ("sensor", "reason"),
           lambda s: (([k, why], n) for (k, why), n in sorted(s.part.bad_readings.items()))),
    Family("qosagent_dvfs_emergency", "gauge", "1 while a thermal emergency holds the lowest point", (),
           one(lambda s: 1.0 if s.part.emergency else 0.0)),
    Family("qosagent_dvfs_load_ratio", "gauge", "Smoothed busy fraction of the policy's CPUs", ("policy",),
           _policies(lambda v: ([v.name], v.load) if v.load is not None else None)),
    Family("qosagent_dvfs_target_frequency_hertz", "gauge", "Frequency of the operating point", ("policy",),
           _policies(lambda v: ([v.name], v.target_khz * 1000.0) if v.target_khz is not None else None)),
    Family("qosagent_dvfs_current_frequency_hertz", "gauge", "scaling_cur_freq, read per policy", ("policy",),
           _policies(lambda v: ([v.name], v.cur_khz * 1000.0) if v.cur_khz is not None else None)),
    Family("qosagent_dvfs_operating_point", "gauge", "1 for the policy's operating point", ("policy", "point"),
           _policies(lambda v: ([v.name, v.point], 1.0) if v.point else None)),
    Family("qosagent_dvfs_transitions", "counter", "Operating-point changes", ("policy",),
           _policies(lambda v: ([v.name], v.transitions) if v.point else None)),
    Family("qosagent_dvfs_last_change_info", "gauge", "What caused the policy's last change", ("policy", "kind"),
           _policies(lambda v: ([v.name, v.kind], 1.0) if v.point else None)),
    Family("qosagent_dvfs_writes", "counter", "Knob writes by result (same: skipped, value there)", ("result",),
           lambda s: (([k], n) for k, n in sorted(s.part.writes.items()))),
    _gpu_family("qosagent_dvfs_gpu_temperature_celsius", "GPU temperature", "temperature_c"),
    _gpu_family("qosagent_dvfs_gpu_power_watts", "GPU power draw", "power_w"),
    _gpu_family("qosagent_dvfs_gpu_power_limit_watts", "Enforced power limit", "power_limit_w"),
    _gpu_family("qosagent_dvfs_gpu_sm_clock_hertz", "SM clock", "sm_clock_mhz", 1e6),
    _gpu_family("qosagent_dvfs_gpu_memory_clock_hertz", "Memory clock", "mem_clock_mhz", 1e6),
    _gpu_family("qosagent_dvfs_gpu_clock_event_reasons", "NVML clock event reasons bitmask", "clock_event_reasons"),
    Family("qosagent_dvfs_gpu_band", "gauge", "1 for the GPU's band (none: no band)", ("gpu", "band"),
           lambda s: (([str(i), b or "none"], 1.0) for i, b in sorted(s.part.gpu_bands.items())),
           shown=lambda s: s.gpus_known),
)


def metrics(part: DvfsPart, gpus: GpuState | None) -> Iterable[Metric]:
    return families(FAMILIES, Source(part, gpus))


def status(part: DvfsPart, gpus: GpuState | None) -> dict[str, Any]:
    gpu_rows = []
    if gpus is not None and gpus.available:
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
