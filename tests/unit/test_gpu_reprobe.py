"""GPU data that appears after start (a driver loaded late, devices injected late) is found by the agent's re-probe,
and its absence is exported with a reason: no silent loss of GPU data."""

from __future__ import annotations

import pytest

from qosagent import config
from qosagent.daemon import Agent
from qosagent.gpu.backend import UNAVAILABLE, GpuError, NoGpu
from qosagent.gpu.fake import FakeBackend
from qosagent.hostfs import HostFS
from qosagent.metrics import AgentCollector


def availability(a: Agent) -> dict[str, float]:
    (fam,) = [m for m in AgentCollector(a).collect() if m.name == "qosagent_gpu_data_available"]
    return {s.labels["reason"]: s.value for s in fam.samples}


@pytest.fixture
def no_caps(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("qosagent.daemon.capabilities.CAPABILITIES", ())


def make(tmp_path, text: str = "latency: {enabled: false}\n", gpu=None) -> Agent:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return Agent(config.load(str(path)), HostFS(tmp_path), str(path), gpu=gpu)


def test_a_driver_that_answers_later_is_found(no_caps, tmp_path, monkeypatch) -> None:
    def no_driver(kind: str, fake_file: str | None = None):
        raise GpuError(UNAVAILABLE, "NVML: driver not loaded")

    monkeypatch.setattr("qosagent.daemon.make_backend", no_driver)
    a = make(tmp_path, "latency: {enabled: false}\ngpu: {backend: nvml}\n")
    a.tick()
    assert a.latest.part("gpu").available is False and availability(a) == {"unavailable": 0.0}
    late = FakeBackend.preset("single")
    late.open()
    monkeypatch.setattr("qosagent.daemon.make_backend", lambda kind, fake_file=None: late)
    a.tick()
    assert a.latest.part("gpu").available is False, "not before gpu.reprobe_interval"
    a._gpu_retry.again()
    a.tick()
    assert a.gpu is late and a.ctx.gpu is late
    assert a.latest.part("gpu").available is True and availability(a) == {"ok": 1.0}


def test_a_backend_off_in_config_or_handed_in_is_not_reopened(no_caps, tmp_path, monkeypatch) -> None:
    off = make(tmp_path, "latency: {enabled: false}\ngpu: {backend: none}\n")
    handed = make(tmp_path, gpu=NoGpu("test"))
    opened: list[str] = []
    monkeypatch.setattr("qosagent.daemon.make_backend", lambda kind, fake_file=None: opened.append(kind))
    for a in (off, handed):
        if a._gpu_retry is not None:
            a._gpu_retry.again()
        a.tick()
    assert opened == [] and availability(off) == {"disabled": 0.0}


def test_reprobe_interval_is_bounded() -> None:
    with pytest.raises(config.ConfigError, match="gpu.reprobe_interval"):
        config.parse({"gpu": {"reprobe_interval": "10ms"}}, "test")
