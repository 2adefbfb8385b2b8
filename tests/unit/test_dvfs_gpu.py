"""GPU bands through the fake GPU: clocks and power limit per band, reset on exit, and the error matrix."""

from __future__ import annotations

import logging

import pytest

from qosagent.capability import AgentContext
from qosagent.dvfs.capability import Dvfs
from qosagent.dvfs.gpuclocks import band_for
from qosagent.dvfs.config import DvfsGpuConfig
from qosagent.gpu.backend import FAILED, GPU_LOST, NO_PERMISSION, NOT_SUPPORTED
from qosagent.gpu.fake import FakeBackend
from tests.unit.dvfs_helpers import CPU, FakeClock, FaultyFS, intel_passive, make_config, make_dvfs, read, tick

CAPPED = {"points": [{"name": "capped", "temp_below_c": 70, "freq": "1600MHz"}, {"name": "full", "freq": "100%"}]}


def setup(tmp_path, preset: str = "h200x8"):
    root = intel_passive(tmp_path / "host")
    gpu = FakeBackend.preset(preset)
    gpu.open()
    clock = FakeClock()
    cap = make_dvfs(FaultyFS(root), make_config(tmp_path, CAPPED), clock, gpu)
    return root, gpu, clock, cap


def heat(gpu: FakeBackend, celsius: float, *indexes: int) -> None:
    for i in indexes or range(len(gpu.gpus)):
        gpu.gpus[i].temperature_c = celsius


def run(cap: Dvfs, gpu: FakeBackend, clock: FakeClock, seq: int = 1):
    return tick(cap, clock, seq, gpu=gpu.sample())


def test_band_choice_with_hysteresis() -> None:
    bands = DvfsGpuConfig().bands
    assert band_for(bands, 70, None, 3) is None
    assert band_for(bands, 84, None, 3) == "warm"
    assert band_for(bands, 90, "warm", 3) == "hot"
    assert band_for(bands, 86, "hot", 3) == "hot"  # within 3 C of hot's start
    assert band_for(bands, 84, "hot", 3) == "warm"
    assert band_for(bands, 81, "warm", 3) == "warm" and band_for(bands, 79, "warm", 3) is None


def test_bands_lock_clocks_and_cap_power_then_reset_on_stop(tmp_path) -> None:
    root, gpu, clock, cap = setup(tmp_path, "single")
    heat(gpu, 85)
    ds = run(cap, gpu, clock)
    assert [(d.target, d.new) for d in ds if d.action == "gpu_band"] == [("gpu0", "warm")]
    assert gpu.writes == [("set_power_limit", 0, 595.0)]  # 85 % of 700 W
    heat(gpu, 90)
    clock.advance(0.1)
    run(cap, gpu, clock, 2)  # hotter: at once, no dwell
    assert gpu.gpus[0].locked_clocks == (210, 1200) and gpu.gpus[0].power_limit_w == 490.0
    heat(gpu, 60)
    clock.advance(0.1)
    run(cap, gpu, clock, 3)
    assert gpu.gpus[0].locked_clocks == (210, 1200)  # cooler: only after the dwell
    clock.advance(6)
    run(cap, gpu, clock, 4)
    assert gpu.gpus[0].locked_clocks is None and gpu.gpus[0].power_limit_w == 700.0
    heat(gpu, 90)
    clock.advance(0.1)
    run(cap, gpu, clock, 5)
    cap.stop()
    assert gpu.gpus[0].locked_clocks is None and gpu.gpus[0].power_limit_w == 700.0
    assert read(root, f"/{CPU}/cpufreq/policy0/scaling_max_freq") == "4500000"


@pytest.mark.parametrize("kind", [NOT_SUPPORTED, NO_PERMISSION])
def test_locked_clocks_refused_switches_that_knob_off_with_one_warning(tmp_path, caplog, kind) -> None:
    root, gpu, clock, cap = setup(tmp_path)
    gpu.fail("set_locked_clocks", kind)
    heat(gpu, 90)
    with caplog.at_level(logging.WARNING, "qosagent.dvfs"):
        run(cap, gpu, clock)
        clock.advance(0.1)
        run(cap, gpu, clock, 2)
    warnings = [r for r in caplog.records if "locked_clocks" in r.message]
    assert len(warnings) == 1 and kind in warnings[0].message
    assert cap.gpu is not None and "locked_clocks" in cap.gpu.off
    # The power limit and the CPU side keep working on every GPU.
    assert all(g.power_limit_w == 490.0 for g in gpu.gpus)
    assert read(root, f"/{CPU}/cpufreq/policy0/scaling_max_freq") == "1600000"
    status = cap.status(_snap(cap, gpu))
    assert status["gpu_off"]["locked_clocks"].startswith(kind)
    assert "gpu locked_clocks: off" in Dvfs.render(status)
    cap.stop()
    assert all(g.power_limit_w == 700.0 for g in gpu.gpus)


@pytest.mark.parametrize("op", ["set_power_limit", "power_limit_constraints"])
@pytest.mark.parametrize("kind", [NOT_SUPPORTED, NO_PERMISSION])
def test_power_limit_refused_keeps_clock_locks(tmp_path, op, kind) -> None:
    root, gpu, clock, cap = setup(tmp_path, "single")
    gpu.fail(op, kind)
    heat(gpu, 90)
    run(cap, gpu, clock)
    assert cap.gpu is not None and set(cap.gpu.off) == {"power_limit"}
    assert gpu.gpus[0].locked_clocks == (210, 1200) and gpu.gpus[0].power_limit_w == 700.0
    cap.stop()
    assert gpu.gpus[0].locked_clocks is None


def test_lost_gpu_and_transient_failures(tmp_path) -> None:
    root, gpu, clock, cap = setup(tmp_path)
    gpu.fail("sample", GPU_LOST, 3)
    gpu.fail("set_locked_clocks", FAILED, 5)
    heat(gpu, 90)
    ds = run(cap, gpu, clock)
    assert "gpu3" not in {d.target for d in ds}
    assert gpu.gpus[3].locked_clocks is None and gpu.gpus[3].power_limit_w == 700.0
    assert gpu.gpus[5].locked_clocks is None and gpu.gpus[5].power_limit_w == 490.0  # FAILED: that write only
    assert cap.gpu is not None and cap.gpu.off == {} and cap.gpu.errors == {FAILED: 1}
    assert gpu.gpus[0].locked_clocks == (210, 1200)
    cap.stop()
    assert all(g.locked_clocks is None and g.power_limit_w == 700.0 for g in gpu.gpus)


def test_gpu_power_limit_changed_by_someone_else_is_left_alone(tmp_path) -> None:
    root, gpu, clock, cap = setup(tmp_path, "single")
    heat(gpu, 85)
    run(cap, gpu, clock)
    gpu.gpus[0].power_limit_w = 650.0  # nvidia-smi -pl by an operator
    lines = cap.restore()
    assert gpu.gpus[0].power_limit_w == 650.0
    assert any("gpu:0:power_limit: left alone" in ln for ln in lines)


def test_gpu_originals_survive_a_crash(tmp_path) -> None:
    root, gpu, clock, cap = setup(tmp_path, "single")
    heat(gpu, 90)
    run(cap, gpu, clock)
    del cap
    fresh = make_dvfs(FaultyFS(root), make_config(tmp_path, CAPPED), clock, gpu)
    assert gpu.gpus[0].locked_clocks is None and gpu.gpus[0].power_limit_w == 700.0
    fresh.stop()


def test_gpu_metrics(tmp_path) -> None:
    root, gpu, clock, cap = setup(tmp_path, "single")
    heat(gpu, 85)
    run(cap, gpu, clock)
    fams = {m.name: m for m in cap.metrics(_snap(cap, gpu))}
    assert fams["qosagent_dvfs_gpu_power_limit_watts"].samples[0].value == 595.0
    assert fams["qosagent_dvfs_gpu_sm_clock_hertz"].samples[0].value == 1980e6
    assert fams["qosagent_dvfs_gpu_band"].samples[0].labels == {"gpu": "0", "band": "warm"}
    assert "band warm" in Dvfs.render(cap.status(_snap(cap, gpu)))
    cap.stop()


def _snap(cap: Dvfs, gpu: FakeBackend):
    from qosagent.snapshot import Snapshot

    return Snapshot.build(1, 0.0, 0.0, {"dvfs": cap.collect(), "gpu": gpu.sample()})


def test_gpu_only_host_runs_the_gpu_bands(tmp_path) -> None:
    # A GPU VM as seen on a real H200: no cpufreq, no CPU temperature sensor, one GPU through NVML.
    from qosagent.features import probe
    from qosagent.hostfs import HostFS

    (tmp_path / "host" / "sys").mkdir(parents=True)
    fs = HostFS(tmp_path / "host")
    gpu = FakeBackend.preset("single")
    gpu.open()
    clock = FakeClock()
    cfg = make_config(tmp_path, CAPPED)
    verdict = Dvfs(AgentContext(config=cfg, hostfs=fs, gpu=gpu, clock=clock)).probe(probe(fs))
    assert verdict.state.value == "active" and "1 GPU(s) only" in verdict.reason
    cap = make_dvfs(fs, cfg, clock, gpu)
    heat(gpu, 85)
    run(cap, gpu, clock)
    assert gpu.gpus[0].power_limit_w == 595.0
    cap.stop()
    assert gpu.gpus[0].power_limit_w == 700.0
