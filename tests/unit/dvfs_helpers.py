"""Sysfs trees for the cpufreq drivers DVFS must handle, a HostFS that fails on demand, and a tick driver."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

from qosagent import config as config_mod
from qosagent.capability import AgentContext
from qosagent.dvfs.capability import Dvfs
from qosagent.gpu.backend import GpuBackend, NoGpu
from qosagent.hostfs import HostFS, HostFSError
from qosagent.snapshot import Decision, Snapshot

CPU = "sys/devices/system/cpu"


def put(root: Path, rel: str, text: str) -> None:
    # Host paths ("/sys/...") are made relative: a leading slash would escape the tree into the real /sys.
    p = root / rel.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")


def read(root: Path, host_path: str) -> str:
    return (root / host_path.lstrip("/")).read_text().strip()


def policy(root: Path, n: int, cpus: str, driver: str, governor: str, lo: int, hi: int, *,
           available: list[int] | None = None, setspeed: str | None = None, cpuinfo: bool = True,
           epp: str | None = None, cur: int | None = None) -> str:
    d = f"{CPU}/cpufreq/policy{n}"
    files = {
        "related_cpus": cpus, "affected_cpus": cpus, "scaling_driver": driver, "scaling_governor": governor,
        "scaling_min_freq": str(lo), "scaling_max_freq": str(hi), "scaling_cur_freq": str(cur or hi),
        "scaling_setspeed": setspeed if setspeed is not None else "<unsupported>",
    }
    if cpuinfo:
        files |= {"cpuinfo_min_freq": str(lo), "cpuinfo_max_freq": str(hi)}
    if available:
        files["scaling_available_frequencies"] = " ".join(map(str, sorted(available, reverse=True)))
    if epp is not None:
        files["energy_performance_preference"] = epp
        files["energy_performance_available_preferences"] = \
            "default performance balance_performance balance_power power"
    for k, v in files.items():
        put(root, f"{d}/{k}", v)
    return "/" + d


def zone(root: Path, n: int, kind: str, milli_c: int | str, critical_milli_c: int | None = None) -> str:
    d = f"sys/class/thermal/thermal_zone{n}"
    put(root, f"{d}/type", kind)
    put(root, f"{d}/temp", str(milli_c))
    if critical_milli_c is not None:
        put(root, f"{d}/trip_point_0_type", "passive")
        put(root, f"{d}/trip_point_0_temp", str(critical_milli_c - 10000))
        put(root, f"{d}/trip_point_1_type", "critical")
        put(root, f"{d}/trip_point_1_temp", str(critical_milli_c))
    return f"/{d}/temp"


def hwmon(root: Path, n: int, name: str, temps: dict[str, int], device: str | None = None) -> None:
    d = f"sys/class/hwmon/hwmon{n}"
    put(root, f"{d}/name", name)
    for i, (label, milli) in enumerate(temps.items(), 1):
        put(root, f"{d}/temp{i}_input", str(milli))
        put(root, f"{d}/temp{i}_label", label)
    if device:
        (root / "sys/devices/platform" / device).mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../devices/platform/{device}", root / d / "device")


def proc_stat(root: Path, busy: dict[int, tuple[int, int]]) -> None:
    """busy: cpu -> (busy jiffies, idle jiffies)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, (b, i) in sorted(busy.items()):
        lines.append(f"cpu{cpu} {b} 0 0 {i} 0 0 0 0 0 0")
    put(root, "proc/stat", "\n".join(lines))


# ---- the drivers ---------------------------------------------------------------------------------------------
def acpi_userspace(root: Path) -> Path:
    """acpi-cpufreq, userspace governor, a frequency table: one policy of two CPUs."""
    policy(root, 0, "0 1", "acpi-cpufreq", "userspace", 800000, 2400000,
           available=[800000, 1200000, 1600000, 2000000, 2400000], setspeed="2400000")
    zone(root, 0, "acpitz", 50000, critical_milli_c=95000)
    proc_stat(root, {0: (0, 0), 1: (0, 0)})
    return root


def two_policies(root: Path, driver: str, governor: str, lo: int, hi: int, **kw: Any) -> None:
    """Two single-CPU policies of one driver, and an idle /proc/stat for their CPUs."""
    for n in (0, 1):
        policy(root, n, str(n), driver, governor, lo, hi, **kw)
    proc_stat(root, {0: (0, 0), 1: (0, 0)})


def intel_passive(root: Path) -> Path:
    """intel_pstate in passive mode (driver intel_cpufreq) under schedutil: no setspeed, per-policy max."""
    two_policies(root, "intel_cpufreq", "schedutil", 400000, 4500000)
    put(root, f"{CPU}/intel_pstate/status", "passive")
    zone(root, 0, "acpitz", 40000)
    zone(root, 1, "x86_pkg_temp", 50000, critical_milli_c=100000)
    return root


def amd_epp(root: Path, governor: str = "powersave") -> Path:
    """amd-pstate-epp (active): scaling_max_freq plus energy_performance_preference."""
    two_policies(root, "amd-pstate-epp", governor, 400000, 3800000, epp="balance_performance")
    hwmon(root, 0, "k10temp", {"Tctl": 50000, "Tccd1": 48000}, device="0000:00:18.3")
    return root


def intel_active(root: Path) -> Path:
    """intel_pstate active (powersave): scaling_max_freq per policy and the global max_perf_pct."""
    two_policies(root, "intel_pstate", "powersave", 800000, 4000000)
    put(root, f"{CPU}/intel_pstate/status", "active")
    put(root, f"{CPU}/intel_pstate/max_perf_pct", "100")
    put(root, f"{CPU}/intel_pstate/min_perf_pct", "20")
    zone(root, 0, "x86_pkg_temp", 50000, critical_milli_c=100000)
    return root


def no_cpufreq(root: Path) -> Path:
    (root / CPU / "cpu0").mkdir(parents=True)
    zone(root, 0, "cpu-thermal", 45000)
    return root


# ---- fault injection -----------------------------------------------------------------------------------------
class FaultyFS(HostFS):
    """HostFS whose reads and writes fail with a chosen errno per path suffix; writes may round like a driver,
    and refuse scaling_max_freq below scaling_min_freq the way old kernels do."""

    def __init__(self, root: Path | str, round_khz: int = 0, old_kernel_order: bool = False):
        super().__init__(root)
        self.write_errors: dict[str, int] = {}
        self.read_errors: dict[str, int] = {}
        self.round_khz = round_khz
        self.old_kernel_order = old_kernel_order
        self.written: list[tuple[str, str]] = []

    def _fail(self, table: dict[str, int], host_path: str) -> None:
        for suffix, err in table.items():
            if host_path.endswith(suffix):
                raise HostFSError(err, os.strerror(err), host_path)

    def read_text(self, host_path: str) -> str:
        self._fail(self.read_errors, host_path)
        return super().read_text(host_path)

    def write_text(self, host_path: str, value: str) -> None:
        self._fail(self.write_errors, host_path)
        if self.old_kernel_order and host_path.endswith(("scaling_max_freq", "scaling_min_freq")):
            d = host_path.rsplit("/", 1)[0]
            lo, hi = int(super().read_text(f"{d}/scaling_min_freq")), int(super().read_text(f"{d}/scaling_max_freq"))
            v = int(value)
            if (host_path.endswith("max_freq") and v < lo) or (host_path.endswith("min_freq") and v > hi):
                raise HostFSError(errno.EINVAL, os.strerror(errno.EINVAL), host_path)
        if self.round_khz and value.isdigit() and host_path.endswith("_freq"):
            value = str((int(value) + self.round_khz // 2) // self.round_khz * self.round_khz)
        self.written.append((host_path, value))
        super().write_text(host_path, value)


# ---- driving the capability ----------------------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def make_config(tmp: Path, dvfs: dict[str, Any] | None = None, **top: Any) -> config_mod.Config:
    data: dict[str, Any] = {"state_dir": str(tmp / "state"), "latency": {"enabled": False},
                            "dvfs": {"enabled": True, "mode": "enforce", "dwell": "5s"} | (dvfs or {})}
    data.update(top)
    return config_mod.parse(data, "test")


def make_dvfs(fs: HostFS, cfg: config_mod.Config, clock: FakeClock, gpu: GpuBackend | None = None) -> Dvfs:
    cap = Dvfs(AgentContext(config=cfg, hostfs=fs, gpu=gpu or NoGpu(), clock=clock))
    cap.start()
    return cap


def tick(cap: Dvfs, clock: FakeClock, seq: int = 1, **parts: Any) -> list[Decision]:
    part = cap.collect()
    snap = Snapshot.build(seq, clock(), time.time(), {"dvfs": part, **parts})
    decisions = cap.decide(snap)
    cap.apply(decisions)
    return decisions


def set_temp(root: Path, host_path: str, celsius: float) -> None:
    (root / host_path.lstrip("/")).write_text(f"{int(celsius * 1000)}\n")
