"""What DVFS shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the Snapshot."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from qosagent.dvfs.model import DvfsPart
from qosagent.gpu.backend import GpuState

if TYPE_CHECKING:
    from prometheus_client.core import Metric


def metrics(part: DvfsPart, gpus: GpuState | None) -> Iterable["Metric"]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
    if gpus is not None and gpus.available:
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
