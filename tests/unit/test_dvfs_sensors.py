"""Sensors through HostFS: chosen by type and name, bad readings discarded and counted, load from /proc/stat."""

from __future__ import annotations

import errno

from qosagent.dvfs import sensors
from qosagent.hostfs import HostFS
from tests.unit.dvfs_helpers import FaultyFS, hwmon, zone

TYPES = ["x86_pkg_temp", "acpitz", "cpu-thermal"]
NAMES = ["coretemp", "k10temp"]


def test_real_snapshot_sensors(copied_sysfs) -> None:
    fs = HostFS(copied_sysfs)
    found = sensors.discover(fs, TYPES, NAMES)
    names = {s.name for s in found}
    assert "cpu-thermal/thermal_zone0" in names
    assert "coretemp:coretemp.0/Physical id 0" in names and "coretemp:coretemp.0/Core 3" in names
    # Other chips (applesmc, nct6775, the wifi phy, a bogus one) are not CPU temperatures.
    assert not any(n.startswith(("applesmc", "nct6775", "iwlwifi")) for n in names)
    reader = sensors.SensorReader(fs, found)
    temps = reader.read()
    assert temps["coretemp:coretemp.0/Physical id 0"] == 55.0
    assert temps["cpu-thermal/thermal_zone0"] == 12.376
    crit = {s.name: s.critical_c for s in found}
    assert crit["coretemp:coretemp.0/Core 0"] == 100.0


def test_chosen_by_type_and_name_never_by_index(tmp_path) -> None:
    zone(tmp_path, 0, "iwlwifi_1", 30000)
    zone(tmp_path, 3, "x86_pkg_temp", 61000, critical_milli_c=100000)
    hwmon(tmp_path, 0, "nvme", {"Composite": 40000})
    hwmon(tmp_path, 5, "coretemp", {"Package id 0": 62000}, device="coretemp.0")
    fs = HostFS(tmp_path)
    found = {s.name: s for s in sensors.discover(fs, TYPES, NAMES)}
    assert set(found) == {"x86_pkg_temp/thermal_zone3", "coretemp:coretemp.0/Package id 0"}
    assert found["x86_pkg_temp/thermal_zone3"].critical_c == 100.0


def test_bad_readings_are_discarded_and_counted_one_never_hides_the_others(tmp_path) -> None:
    zone(tmp_path, 0, "acpitz", -32768000)  # thermald#150's sentinel
    zone(tmp_path, 1, "acpitz", 900000)  # 900 C: absurd
    zone(tmp_path, 2, "acpitz", "garbage")
    zone(tmp_path, 3, "acpitz", 47000)
    zone(tmp_path, 4, "x86_pkg_temp", 55000)
    fs = FaultyFS(tmp_path)
    fs.read_errors["thermal_zone4/temp"] = errno.ENODATA
    reader = sensors.SensorReader(fs, sensors.discover(fs, TYPES, NAMES))
    for _ in range(3):
        temps = reader.read()
    assert temps == {"acpitz/thermal_zone3": 47.0}
    assert reader.bad == {
        ("acpitz/thermal_zone0", "sentinel"): 3,
        ("acpitz/thermal_zone1", "absurd"): 3,
        ("acpitz/thermal_zone2", "unparsable"): 3,
        ("x86_pkg_temp/thermal_zone4", "ENODATA"): 3,
    }
    fs.read_errors.clear()
    assert reader.read()["x86_pkg_temp/thermal_zone4"] == 55.0


def test_absurd_critical_trips_are_ignored(tmp_path) -> None:
    zone(tmp_path, 0, "acpitz", 40000, critical_milli_c=-273000)
    zone(tmp_path, 1, "acpitz", 40000, critical_milli_c=20000)  # a firmware placeholder, not a limit
    hwmon(tmp_path, 0, "coretemp", {"Core 0": 40000})
    (tmp_path / "sys/class/hwmon/hwmon0/temp1_crit").write_text("0\n")
    assert [s.critical_c for s in sensors.discover(HostFS(tmp_path), TYPES, NAMES)] == [None, None, None]


PROC_STAT = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 400 0 0 0 0 0 0
cpu1 50 0 50 400 100 0 0 0 0 0
intr 12345
ctxt 999
"""


def test_parse_proc_stat() -> None:
    stat = sensors.parse_proc_stat(PROC_STAT)
    assert stat == {0: (100, 500), 1: (100, 600)}  # iowait is idle


def test_load_is_smoothed_per_policy() -> None:
    lt = sensors.LoadTracker(tau_s=1.0, groups={"policy0": (0,), "policy1": (1,)})
    busy = {0: [0, 0], 1: [0, 0]}

    def advance(b0: int, b1: int) -> dict[int, tuple[int, int]]:
        # 10 jiffies per 100 ms per CPU (USER_HZ 100)
        busy[0] = [busy[0][0] + b0, busy[0][1] + 10]
        busy[1] = [busy[1][0] + b1, busy[1][1] + 10]
        return {c: (v[0], v[1]) for c, v in busy.items()}

    t = 0.0
    for _ in range(5):
        t += 0.1
        assert lt.update(t, advance(0, 0)).get("policy0", 0.0) == 0.0
    for _ in range(5):
        t += 0.1
        loads = lt.update(t, advance(10, 0))
    # A step to 100 % on CPU 0 rises with the time constant (1 - e^-0.5 ~ 0.39 after 0.5 s), CPU 1 stays idle.
    assert 0.3 < loads["policy0"] < 0.5 and loads["policy1"] == 0.0
    for _ in range(50):
        t += 0.1
        loads = lt.update(t, advance(10, 0))
    assert loads["policy0"] > 0.99
    # Counters going backwards (hotplug) are skipped, not turned into negative load.
    t += 0.1
    assert lt.update(t, {0: (0, 0), 1: (0, 0)})["policy0"] > 0.99
