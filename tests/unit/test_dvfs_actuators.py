"""The capability against fixture trees: the actuator each driver gets, the files it writes, faults, rollback."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from qosagent.admission.model import AdmissionPart
from qosagent.hist import Histogram
from qosagent.latency.model import LatencyPart
from qosagent.slo import SloVerdict
from qosagent.capability import AgentContext, CapabilityError, State
from qosagent.dvfs.capability import Dvfs
from qosagent.dvfs.rollback import FILE_NAME
from qosagent.features import probe as probe_features
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.snapshot import Snapshot
from tests.unit.dvfs_helpers import (
    CPU,
    FakeClock,
    FaultyFS,
    acpi_userspace,
    amd_epp,
    intel_active,
    intel_passive,
    make_config,
    make_dvfs,
    no_cpufreq,
    proc_stat,
    put,
    read,
    set_temp,
    tick,
)

# A table that depends on temperature only, so that these tests need no load history.
CAPPED = {"points": [{"name": "capped", "temp_below_c": 70, "freq": "1600MHz", "epp": "power"},
                     {"name": "full", "freq": "100%"}]}
P0 = f"/{CPU}/cpufreq/policy0"
P1 = f"/{CPU}/cpufreq/policy1"


def setup(tmp_path: Path, build, dvfs: dict | None = None, fs_cls=FaultyFS, **fs_kw):
    root = build(tmp_path / "host")
    fs = fs_cls(root, **fs_kw)
    clock = FakeClock()
    cfg = make_config(tmp_path, CAPPED | (dvfs or {}))
    return root, fs, clock, cfg


def state_file(tmp_path: Path) -> Path:
    return tmp_path / "state" / FILE_NAME


def test_acpi_cpufreq_userspace_uses_setspeed_snapped_to_the_table(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, acpi_userspace, {"points": [
        {"name": "capped", "temp_below_c": 70, "freq": "1700MHz"}, {"name": "full", "freq": "100%"}]})
    cap = make_dvfs(fs, cfg, clock)
    assert cap.probe(probe_features(fs)).state is State.ACTIVE
    (p,) = cap.policies
    assert (p.name, p.cpus, p.actuator) == ("policy0", (0, 1), "scaling_setspeed")
    (d,) = tick(cap, clock)
    assert (d.target, d.old, d.new, d.applied) == ("policy0", None, "capped", True)
    # 1700 MHz is not in scaling_available_frequencies: the next one down is.
    assert fs.written == [(f"{P0}/scaling_setspeed", "1600000")]
    assert read(root, f"{P0}/scaling_max_freq") == "2400000"
    assert json.loads(state_file(tmp_path).read_text())["entries"][0]["original"] == "2400000"
    cap.stop()
    assert read(root, f"{P0}/scaling_setspeed") == "2400000"
    assert not state_file(tmp_path).exists()


def test_intel_pstate_passive_uses_scaling_max_freq_per_policy(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    assert [(p.driver, p.actuator) for p in cap.policies] == [("intel_cpufreq", "scaling_max_freq")] * 2
    tick(cap, clock)
    # One write per policy; min was already below the target, so it is left untouched.
    assert fs.written == [(f"{P0}/scaling_max_freq", "1600000"), (f"{P1}/scaling_max_freq", "1600000")]
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 80)
    clock.advance(6)
    tick(cap, clock, 2)
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"
    clock.advance(1)
    tick(cap, clock, 3)  # no change, no write
    assert len(fs.written) == 4
    cap.stop()
    assert not state_file(tmp_path).exists()


def test_amd_pstate_epp_writes_max_freq_then_epp_and_restores_both(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, amd_epp)
    cap = make_dvfs(fs, cfg, clock)
    p = cap.policies[0]
    assert p.actuator == "scaling_max_freq" and "power" in p.epp_prefs
    tick(cap, clock)
    assert fs.written[:2] == [(f"{P0}/scaling_max_freq", "1600000"), (f"{P0}/energy_performance_preference", "power")]
    # Back to full: the point sets no EPP, so the host's own preference comes back.
    (root / "sys/class/hwmon/hwmon0/temp1_input").write_text("80000\n")
    clock.advance(6)
    tick(cap, clock, 2)
    assert read(root, f"{P0}/energy_performance_preference") == "balance_performance"
    assert read(root, f"{P0}/scaling_max_freq") == "3800000"
    (root / "sys/class/hwmon/hwmon0/temp1_input").write_text("50000\n")
    clock.advance(6)
    tick(cap, clock, 3)
    cap.stop()
    for pol in (P0, P1):
        assert read(root, f"{pol}/energy_performance_preference") == "balance_performance"
        assert read(root, f"{pol}/scaling_max_freq") == "3800000"


def test_epp_is_not_offered_under_the_performance_governor(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, lambda r: amd_epp(r, governor="performance"))
    cap = make_dvfs(fs, cfg, clock)
    assert cap.policies[0].epp_prefs == ()
    tick(cap, clock)
    assert all(not path.endswith("energy_performance_preference") for path, _ in fs.written)


def test_epp_ebusy_switches_epp_off_and_keeps_frequency(tmp_path, caplog) -> None:
    root, fs, clock, cfg = setup(tmp_path, amd_epp)
    fs.write_errors["energy_performance_preference"] = errno.EBUSY
    cap = make_dvfs(fs, cfg, clock)
    with caplog.at_level(logging.WARNING, "qosagent.dvfs"):
        tick(cap, clock)
    assert read(root, f"{P0}/scaling_max_freq") == "1600000"
    assert cap.cpu.epp_off == {"policy0": "EBUSY (performance governor?)", "policy1": "EBUSY (performance governor?)"}
    assert sum("EBUSY" in r.message for r in caplog.records) == 2
    assert cap.cpu.writes["failed_EBUSY"] == 2
    cap.stop()
    assert read(root, f"{P0}/scaling_max_freq") == "3800000"


def test_intel_pstate_active_max_perf_pct_is_one_global_write(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_active, {"actuator": "max_perf_pct"})
    cap = make_dvfs(fs, cfg, clock)
    assert {p.actuator for p in cap.policies} == {"max_perf_pct"}
    tick(cap, clock)
    assert fs.written == [(f"/{CPU}/intel_pstate/max_perf_pct", "40")]  # 1600 of 4000 MHz
    cap.stop()
    assert read(root, f"/{CPU}/intel_pstate/max_perf_pct") == "100"
    # auto picks the per-policy knob on the same host.
    cap2 = make_dvfs(HostFS(root), make_config(tmp_path, CAPPED), clock)
    assert {p.actuator for p in cap2.policies} == {"scaling_max_freq"}


def test_configured_actuator_that_the_driver_lacks_is_monitor_only(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive, {"actuator": "scaling_setspeed"})
    cap = make_dvfs(fs, cfg, clock)
    v = cap.probe(probe_features(fs))
    assert v.state is State.DEGRADED and "scaling_setspeed not offered" in v.reason
    assert tick(cap, clock) == [] and fs.written == []


def test_real_snapshot_intel_pstate_with_missing_cpuinfo(copied_sysfs, tmp_path) -> None:
    fs = FaultyFS(copied_sysfs)
    clock = FakeClock()
    cap = make_dvfs(fs, make_config(tmp_path, CAPPED), clock)
    assert [(p.name, p.dir.rsplit("/", 2)[1], p.actuator) for p in cap.policies] == [
        (f"policy{i}", f"cpu{i}", "scaling_max_freq") for i in range(4)]
    # No cpuinfo_*_freq in the snapshot: the range is what the host allowed when the agent started.
    assert [(p.min_khz, p.max_khz) for p in cap.policies] == [(800000, 3700000)] * 2 + [(1000, 4200000)] * 2
    ds = tick(cap, clock)
    assert {d.new for d in ds} == {"capped"}
    for i in range(4):
        assert read(copied_sysfs, f"/{CPU}/cpu{i}/cpufreq/scaling_max_freq") == "1600000"
    part = cap.collect()
    assert part.hottest_c == 55.0 and part.policies[0].cur_khz == 1699981
    cap.stop()
    assert [read(copied_sysfs, f"/{CPU}/cpu{i}/cpufreq/scaling_max_freq") for i in range(4)] == \
        ["3700000", "3700000", "4200000", "4200000"]


def test_no_cpufreq_monitors_temperatures_only(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, no_cpufreq)
    cap = make_dvfs(fs, cfg, clock)
    v = cap.probe(probe_features(fs))
    assert v.state is State.IDLE and "monitoring temperatures only" in v.reason
    assert tick(cap, clock) == []
    assert cap.collect().temperatures == {"cpu-thermal/thermal_zone0": 45.0}
    assert "monitoring temperatures only" in Dvfs.render(cap.status(_snap(cap)))


def test_nothing_at_all_is_unavailable(tmp_path) -> None:
    (tmp_path / "host/sys").mkdir(parents=True)
    cap = Dvfs(AgentContext(config=make_config(tmp_path), hostfs=HostFS(tmp_path / "host"), gpu=NoGpu()))
    assert cap.probe(probe_features(cap.ctx.hostfs)).state is State.UNAVAILABLE


def test_min_is_lowered_first_and_raised_last_so_old_kernels_never_refuse(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive, old_kernel_order=True)
    put(root, f"{P0}/scaling_min_freq", "2000000")  # an operator's raised floor
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    assert fs.written[:2] == [(f"{P0}/scaling_min_freq", "1600000"), (f"{P0}/scaling_max_freq", "1600000")]
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 80)
    clock.advance(6)
    fs.written.clear()
    tick(cap, clock, 2)
    assert fs.written[:2] == [(f"{P0}/scaling_max_freq", "4500000"), (f"{P0}/scaling_min_freq", "2000000")]
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 50)
    clock.advance(6)
    tick(cap, clock, 3)
    assert cap.cpu.writes.get("failed_EINVAL", 0) == 0
    cap.stop()  # reverse order: max up first, then min
    assert read(root, f"{P0}/scaling_min_freq") == "2000000"
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"


def test_einval_is_counted_and_retried_on_the_next_change(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    fs.write_errors["policy0/scaling_max_freq"] = errno.EINVAL
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"
    assert read(root, f"{P1}/scaling_max_freq") == "1600000"
    assert cap.cpu.writes["failed_EINVAL"] == 1 and "policy0" not in cap.cpu.notes
    fs.write_errors.clear()
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 80)
    clock.advance(6)
    tick(cap, clock, 2)
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 50)
    clock.advance(6)
    tick(cap, clock, 3)
    assert read(root, f"{P0}/scaling_max_freq") == "1600000"
    cap.stop()


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_read_only_knob_makes_that_policy_monitor_only(tmp_path, err) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    fs.write_errors["policy1/scaling_max_freq"] = err
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    assert "monitor only" in cap.cpu.notes["policy1"] and errno.errorcode[err] in cap.cpu.notes["policy1"]
    assert read(root, f"{P0}/scaling_max_freq") == "1600000"
    # The policy is left alone from now on; the other keeps working.
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 80)
    clock.advance(6)
    ds = tick(cap, clock, 2)
    assert [d.target for d in ds] == ["policy0"]
    status = cap.status(_snap(cap))
    assert "monitor only" in Dvfs.render(status)
    cap.stop()
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"


def test_driver_rounding_is_accepted_on_read_back_and_not_rewritten(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive, {"points": [
        {"name": "capped", "temp_below_c": 70, "freq": "1650MHz"}, {"name": "full", "freq": "100%"}]},
        round_khz=100000)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    assert read(root, f"{P0}/scaling_max_freq") == "1700000"
    assert cap.cpu.writes["written"] == 2 and "mismatch" not in cap.cpu.writes
    # The rounded value is ours: restarting the point writes nothing, and restore recognizes it.
    assert cap.originals.is_ours(f"file:{P0}/scaling_max_freq", "1700000")
    cap.stop()
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"


def test_read_back_beyond_tolerance_is_a_counted_mismatch(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive, {"readback_tolerance_mhz": 0, "points": [
        {"name": "capped", "temp_below_c": 70, "freq": "1650MHz"}, {"name": "full", "freq": "100%"}]},
        round_khz=100000)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    assert cap.cpu.writes["mismatch"] == 2
    cap.stop()
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"


def test_value_changed_by_someone_else_is_left_alone_and_reported(tmp_path, caplog) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    put(root, f"{P0}/scaling_max_freq", "3000000")  # another tool (tuned, an operator) steps in
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 80)
    clock.advance(6)
    with caplog.at_level(logging.WARNING, "qosagent.dvfs"):
        tick(cap, clock, 2)
    assert read(root, f"{P0}/scaling_max_freq") == "3000000"
    assert cap.cpu.notes["policy0"].startswith("yielded")
    assert any("someone else" in r.message for r in caplog.records)
    lines = cap.restore()
    assert read(root, f"{P0}/scaling_max_freq") == "3000000"
    assert not any("policy0" in ln and "restored" in ln for ln in lines)


def test_restore_at_stop_leaves_a_foreign_value_and_says_so(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    put(root, f"{P1}/scaling_max_freq", "2800000")
    lines = cap.restore()
    assert read(root, f"{P1}/scaling_max_freq") == "2800000"
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"
    assert any("policy1/scaling_max_freq: left alone, changed by someone else" in ln for ln in lines)
    # Restoring twice is harmless: nothing is left, nothing is written.
    fs.written.clear()
    assert cap.restore() == [] and fs.written == []
    cap.stop()
    assert fs.written == []


def test_crash_then_restart_restores_from_persisted_originals(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    crashed = make_dvfs(fs, cfg, clock)
    tick(crashed, clock)
    del crashed  # no stop(): the process died
    assert read(root, f"{P0}/scaling_max_freq") == "1600000" and state_file(tmp_path).exists()
    set_temp(root, "/sys/class/thermal/thermal_zone1/temp", 80)  # the new agent will not want a cap
    fresh = make_dvfs(HostFS(root), cfg, clock)  # start() recovers first
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"
    assert not state_file(tmp_path).exists()
    tick(fresh, clock)
    fresh.stop()
    assert read(root, f"{P1}/scaling_max_freq") == "4500000"


def test_crash_between_write_and_bookkeeping_still_counts_as_ours(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    # Simulate dying right after the write: the original and the pending value are on disk, the read-back not.
    cap.originals.before_write(f"file:{P0}/scaling_max_freq", "4500000", "1600000")
    put(root, f"{P0}/scaling_max_freq", "1600000")
    lines = Dvfs.detach(cap.ctx)
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"
    assert any("restored 4500000" in ln for ln in lines)
    assert Dvfs.detach(cap.ctx) == []  # twice: nothing left


def test_detach_without_an_agent(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, amd_epp)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    lines = Dvfs.detach(AgentContext(config=cfg, hostfs=HostFS(root), gpu=NoGpu()))
    assert len(lines) == 4  # two policies, max freq and EPP each
    assert read(root, f"{P1}/energy_performance_preference") == "balance_performance"
    assert read(root, f"{P1}/scaling_max_freq") == "3800000"


def test_originals_of_another_host_root_are_refused(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    state_file(tmp_path).parent.mkdir(parents=True)
    state_file(tmp_path).write_text(json.dumps({"version": 1, "host_root": "/elsewhere", "entries": []}))
    with pytest.raises(CapabilityError, match="host root"):
        make_dvfs(fs, cfg, clock)
    assert "host root" in Dvfs.detach(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu()))[0]


def test_dry_run_writes_nothing_and_saves_nothing(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive, {"mode": "dry-run"})
    cap = make_dvfs(fs, cfg, clock)
    ds = tick(cap, clock)
    assert ds and all(not d.applied for d in ds)
    assert fs.written == [] and not state_file(tmp_path).exists()
    cap.stop()
    assert fs.written == []


def _busy(root: Path, jiffies: dict[int, list[int]], frac: float, n: int = 10) -> None:
    for c in jiffies:
        jiffies[c][0] += int(n * frac)
        jiffies[c][1] += n - int(n * frac)
    proc_stat(root, {c: (b, i) for c, (b, i) in jiffies.items()})


def test_default_table_with_load_and_admission_near_slo(tmp_path) -> None:
    root = amd_epp(tmp_path / "host")
    fs = FaultyFS(root)
    clock = FakeClock()
    cap = make_dvfs(fs, make_config(tmp_path), clock)
    jiffies = {0: [0, 0], 1: [0, 0]}
    for i in range(3):
        _busy(root, jiffies, 0.1)
        clock.advance(0.1)
        tick(cap, clock, i)
    # Unknown load at the first tick reads as busy (full); the idle point comes after the dwell.
    assert read(root, f"{P0}/scaling_max_freq") == "3800000"
    clock.advance(6)
    _busy(root, jiffies, 0.1)
    tick(cap, clock, 3)
    assert read(root, f"{P0}/scaling_max_freq") == "800000"
    assert read(root, f"{P0}/energy_performance_preference") == "balance_power"
    # gold nears its SLO: the idle cap goes, frequency is raised for latency.
    clock.advance(6)
    _busy(root, jiffies, 0.1)
    # gold's P95 at 110 ms against its 120 ms SLO
    near = SloVerdict({"acme": ("gold", Histogram.of([110_000_000] * 20))}, {"acme": 0.12}, {"gold": 0.12}, "ttft",
                      0.95, 0.8, 0.9)
    ds = tick(cap, clock, 4, admission=AdmissionPart(), latency=LatencyPart(1.0, verdict=near))
    assert {d.inputs["kind"] for d in ds} == {"near_slo"}
    assert read(root, f"{P0}/scaling_max_freq") == "3800000"
    cap.stop()


def test_emergency_goes_to_the_lowest_point_through_the_capability(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, acpi_userspace, {"emergency_readings": 2, "dwell": "1h"})
    cap = make_dvfs(fs, cfg, clock)
    assert cap.critical_c == 95.0
    tick(cap, clock)
    set_temp(root, "/sys/class/thermal/thermal_zone0/temp", 97)
    ds = []
    for i in range(2):
        clock.advance(0.1)
        ds += tick(cap, clock, 2 + i)
    assert [(d.new, d.inputs["kind"]) for d in ds] == [("capped", "emergency")]  # capped is the lowest here
    assert cap.collect().emergency
    cap.stop()


def _snap(cap: Dvfs) -> Snapshot:
    return Snapshot.build(1, 0.0, 0.0, {"dvfs": cap.collect()})


def test_metrics_and_status_show_what_it_did(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, acpi_userspace)
    fs.read_errors["thermal_zone9/temp"] = errno.EIO
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    snap = _snap(cap)
    fams = {m.name: m for m in cap.metrics(snap)}
    for name in ("qosagent_dvfs_temperature_celsius", "qosagent_dvfs_target_frequency_hertz",
                 "qosagent_dvfs_current_frequency_hertz", "qosagent_dvfs_operating_point", "qosagent_dvfs_transitions",
                 "qosagent_dvfs_last_change_info", "qosagent_dvfs_writes", "qosagent_dvfs_bad_readings",
                 "qosagent_dvfs_emergency", "qosagent_dvfs_load_ratio"):
        assert name in fams, name
    (target,) = fams["qosagent_dvfs_target_frequency_hertz"].samples
    assert target.labels == {"policy": "policy0"} and target.value == 1.6e9
    (point,) = fams["qosagent_dvfs_operating_point"].samples
    assert point.labels == {"policy": "policy0", "point": "capped"}
    (last,) = fams["qosagent_dvfs_last_change_info"].samples
    assert last.labels["kind"] == "start"
    status = cap.status(snap)
    json.dumps(status)
    text = Dvfs.render(status)
    assert "policy0" in text and "scaling_setspeed" in text and "capped" in text and "1600" in text
    assert "acpitz/thermal_zone0 50.0" in text
    cap.stop()


def test_reload_takes_a_new_table(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    cap.prepare(make_config(tmp_path, {"points": [
        {"name": "tight", "temp_below_c": 70, "freq": "1200MHz"}, {"name": "full", "freq": "100%"}]})).commit()
    # The old point is gone from the table: the next tick picks from the new one without waiting for a dwell.
    clock.advance(0.1)
    (d, _) = tick(cap, clock, 2)
    assert (d.old, d.new) == (None, "tight")
    assert read(root, f"{P0}/scaling_max_freq") == "1200000"
    cap.stop()
    assert read(root, f"{P0}/scaling_max_freq") == "4500000"


def test_an_undone_reload_leaves_the_old_table(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    before = (cap.cfg, cap.params, cap.states)
    change = cap.prepare(make_config(tmp_path, {"points": [
        {"name": "tight", "temp_below_c": 70, "freq": "1200MHz"}, {"name": "full", "freq": "100%"}]}))
    assert (cap.cfg, cap.params, cap.states) == before  # prepared, not taken
    change.commit()
    assert cap.params != before[1]
    change.undo()
    assert (cap.cfg, cap.params, cap.states) == before
    cap.stop()


def test_restore_skips_a_knob_that_is_gone_and_keeps_one_that_fails(tmp_path) -> None:
    root, fs, clock, cfg = setup(tmp_path, intel_passive)
    cap = make_dvfs(fs, cfg, clock)
    tick(cap, clock)
    fs.write_errors["policy0/scaling_max_freq"] = errno.EBUSY
    (root / P1.lstrip("/") / "scaling_max_freq").unlink()  # policy1's CPU went offline
    lines = cap.restore()
    assert any("policy1/scaling_max_freq: gone" in ln for ln in lines)
    assert any("policy0/scaling_max_freq: restoring 4500000 failed" in ln for ln in lines)
    assert list(json.loads(state_file(tmp_path).read_text())["entries"][0].values())[0].endswith("policy0/"
                                                                                              "scaling_max_freq")
    fs.write_errors.clear()
    assert any("restored 4500000" in ln for ln in Dvfs.detach(cap.ctx))
    assert not state_file(tmp_path).exists()


@pytest.mark.parametrize("driver", ["acpi-cpufreq", "intel_cpufreq", "amd-pstate"])
def test_userspace_governor_gets_setspeed_on_every_passive_driver(tmp_path, driver) -> None:
    from qosagent import cpufreq
    from tests.unit.dvfs_helpers import policy

    policy(tmp_path, 0, "0", driver, "userspace", 800000, 3000000, setspeed="3000000")
    policy(tmp_path, 1, "1", driver, "ondemand", 800000, 3000000, setspeed="<unsupported>")
    got = [(p.name, p.actuator) for p in cpufreq.discover(HostFS(tmp_path))]
    assert got == [("policy0", "scaling_setspeed"), ("policy1", "scaling_max_freq")]


def test_targets_are_clamped_and_snapped() -> None:
    from qosagent.cpufreq import Policy
    from qosagent.dvfs.cpufreq import resolve_khz

    p = Policy("policy0", "/x", (0,), "acpi-cpufreq", "userspace", 800000, 2400000)
    assert resolve_khz(p, "khz", 400000) == 800000  # the design's 400 MHz below cpuinfo_min_freq
    assert resolve_khz(p, "khz", 5e6) == 2400000
    assert resolve_khz(p, "pct", 50) == 1200000
    table = Policy("policy0", "/x", (0,), "acpi-cpufreq", "userspace", 1000000, 2400000,
                   available=(1000000, 1700000, 2400000))
    assert resolve_khz(table, "khz", 2000000) == 1700000 and resolve_khz(table, "khz", 400000) == 1000000
    unknown = Policy("policy0", "/x", (0,), "x", "y", None, None)
    assert resolve_khz(unknown, "pct", 50) is None and resolve_khz(unknown, "khz", 1e6) == 1000000
