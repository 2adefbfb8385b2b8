"""The config file watch: an edit, a rename over the file and a ConfigMap's symlink swap each reload once; a touch,
a swap to the same text and a vanished file reload nothing; a bad new config is refused and the old one runs on."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from testkit.agent import AgentThread

from qosagent import config
from qosagent.configwatch import ConfigWatch
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(path: Path, clock: Clock) -> ConfigWatch:
    return ConfigWatch(str(path), 5.0, clock)


def polled(w: ConfigWatch, clock: Clock) -> bool:
    clock.now += 5.0
    return w.changed()


def test_an_edit_in_place_or_a_rename_over_the_file_is_one_change(tmp_path: Path) -> None:
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    assert not polled(w, clock)
    path.write_text("interval: 200ms\n")
    assert not w.changed(), "not before the interval has passed"
    assert polled(w, clock) and not polled(w, clock)
    new = tmp_path / "c.yaml.new"
    new.write_text("interval: 300ms\n")
    os.replace(new, path)
    assert polled(w, clock) and not polled(w, clock)


def test_a_configmap_symlink_swap_is_one_change(tmp_path: Path) -> None:
    """kubelet writes a new ..<timestamp> directory and swaps ..data to it; config.yaml links through ..data."""
    vol, clock = tmp_path / "vol", Clock()
    (vol / "..2026_01").mkdir(parents=True)
    (vol / "..2026_01" / "config.yaml").write_text("interval: 100ms\n")
    (vol / "..data").symlink_to("..2026_01")
    (vol / "config.yaml").symlink_to("..data/config.yaml")
    w = watch(vol / "config.yaml", clock)
    (vol / "..2026_02").mkdir()
    (vol / "..2026_02" / "config.yaml").write_text("interval: 200ms\n")
    (vol / "..data_tmp").symlink_to("..2026_02")
    os.replace(vol / "..data_tmp", vol / "..data")
    assert polled(w, clock) and not polled(w, clock)
    # The same text again (kubelet resyncing, an operator re-applying): nothing to reload.
    (vol / "..2026_03").mkdir()
    (vol / "..2026_03" / "config.yaml").write_text("interval: 200ms\n")
    (vol / "..data_tmp").symlink_to("..2026_03")
    os.replace(vol / "..data_tmp", vol / "..data")
    assert not polled(w, clock)


def test_a_touch_or_a_vanished_file_is_no_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    os.utime(path, ns=(1, 1))
    assert not polled(w, clock)
    path.unlink()
    assert not polled(w, clock) and not polled(w, clock)
    assert [r.message for r in caplog.records].count(f"config file {path} is gone; the running config stays") == 1
    path.write_text("interval: 100ms\n")
    assert not polled(w, clock), "back with the text already running"
    path.write_text("interval: 150ms\n")
    assert polled(w, clock)


def wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        threading.Event().wait(0.02)


def test_the_agent_reloads_a_changed_file_and_refuses_a_bad_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("qosagent.daemon.capabilities.CAPABILITIES", ())
    path = tmp_path / "cfg.yaml"
    base = "latency: {enabled: false}\nconfig_watch: {interval: 100ms}\n"
    path.write_text("interval: 20ms\n" + base)
    a = Agent(config.load(str(path)), HostFS(tmp_path), str(path), gpu=NoGpu())
    with AgentThread(a, timeout=5):
        path.write_text("interval: 30ms\n" + base)
        wait_for(lambda: a.stats.reloads_ok == 1)
        assert a.config.interval == pytest.approx(0.03)
        path.write_text("interval: fast\n" + base)
        wait_for(lambda: a.stats.reloads_failed == 1)
        assert a.config.interval == pytest.approx(0.03) and "interval" in a.stats.last_reload_error
        threading.Event().wait(0.3)
        assert a.stats.reloads_failed == 1, "the same bad text is not tried again"
        path.write_text("interval: 40ms\nlatency: {enabled: false}\nconfig_watch: {enabled: false}\n")
        wait_for(lambda: a.stats.reloads_ok == 2)
        path.write_text("interval: 50ms\n" + base)
        threading.Event().wait(0.4)
        assert a.stats.reloads_ok == 2 and a.config.interval == pytest.approx(0.04), "the watch is off now"


def test_a_reload_asked_for_is_not_repeated_by_the_watch(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("qosagent.daemon.capabilities.CAPABILITIES", ())
    path = tmp_path / "cfg.yaml"
    path.write_text("interval: 20ms\nlatency: {enabled: false}\n")
    a = Agent(config.load(str(path)), HostFS(tmp_path), str(path), gpu=NoGpu())
    path.write_text("interval: fast\nlatency: {enabled: false}\n")
    assert a.reload()[0] is False
    a._watch._next = 0  # due now
    assert not a._config_changed(), "the text the explicit reload refused is not tried again"
    assert a.stats.reloads_failed == 1
