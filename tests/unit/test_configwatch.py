"""The config file watch: an edit, a rename over the file and a ConfigMap's symlink swap each reload once; a touch,
a swap to the same text and a vanished file reload nothing; a bad new config is refused and the old one runs on."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from testkit.agent import AgentThread

from qosagent import config, configwatch
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


def settled(w: ConfigWatch, clock: Clock) -> bool:
    """What the watch makes of a change once its text has stood still for an interval: never at the first poll."""
    assert not polled(w, clock), "a new text is acted on only once two polls in a row have read it"
    return polled(w, clock)


def test_an_edit_in_place_or_a_rename_over_the_file_is_one_change(tmp_path: Path) -> None:
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    assert not polled(w, clock)
    path.write_text("interval: 200ms\n")
    assert not w.changed(), "not before the interval has passed"
    assert settled(w, clock) and not polled(w, clock)
    new = tmp_path / "c.yaml.new"
    new.write_text("interval: 300ms\n")
    os.replace(new, path)
    assert settled(w, clock) and not polled(w, clock)


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
    assert settled(w, clock) and not polled(w, clock)
    # The same text again (kubelet resyncing, an operator re-applying): nothing to reload.
    (vol / "..2026_03").mkdir()
    (vol / "..2026_03" / "config.yaml").write_text("interval: 200ms\n")
    (vol / "..data_tmp").symlink_to("..2026_03")
    os.replace(vol / "..data_tmp", vol / "..data")
    assert not settled(w, clock)


def test_a_touch_or_a_vanished_file_is_no_change(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    os.utime(path, ns=(1, 1))
    assert not settled(w, clock)
    path.unlink()
    assert not polled(w, clock) and not polled(w, clock)
    assert [r.message for r in caplog.records].count(f"config file {path} is gone; the running config stays") == 1
    path.write_text("interval: 100ms\n")
    assert not settled(w, clock), "back with the text already running"
    path.write_text("interval: 150ms\n")
    assert settled(w, clock)


def test_a_file_seen_mid_write_is_not_reloaded(tmp_path: Path) -> None:
    """An edit in place truncates before it writes: a poll between the two sees an empty file, which is a valid
    config (every default) and must not be applied; the new text, once it stands still, is one change."""
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    with open(path, "w") as f:
        f.truncate()
        assert not polled(w, clock), "the truncated file is not taken for a new config"
        f.write("interval: 200ms\n")
    assert settled(w, clock) and not polled(w, clock)


def test_a_write_in_the_same_mtime_tick_with_the_same_size_is_seen(tmp_path: Path) -> None:
    """Two writes of the same size within one mtime tick (a jiffy) leave the same stat: while the mtime is that
    recent the content is read as well, so the second write is not lost."""
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    mtime = path.stat().st_mtime_ns
    path.write_text("interval: 200ms\n")
    os.utime(path, ns=(mtime, mtime))  # the same tick as the text the watch began with
    assert settled(w, clock) and not polled(w, clock)


def churned(path: Path, how: str, i: int) -> None:
    """What a render loop or a cron job does to the file between two polls without changing its text: a touch, a
    rewrite in place of the same text, or the same text renamed over it. Each leaves a new mtime (a past one, so the
    watch is left to go by the stat), and a rename a new inode too."""
    text = path.read_text()
    if how == "rewrite":
        path.write_text(text)
    elif how == "rename":
        new = path.with_name(path.name + ".new")
        new.write_text(text)
        os.replace(new, path)
    t = (1_000_000 + i) * 1_000_000_000
    os.utime(path, ns=(t, t))


@pytest.mark.parametrize("how", ["touch", "rewrite", "rename"])
def test_a_file_whose_stat_moves_before_every_poll_still_reloads_an_edit_once(tmp_path: Path, how: str) -> None:
    """Review of 6fefa06: a file whose stat changes between every two polls never stood still for an interval, so
    an edit of it was never reloaded. The text standing still across two polls is what counts: the churn alone is
    no change, and an edit reloads once, at the first or second poll after it."""
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    w = watch(path, clock)
    for i in range(4):
        churned(path, how, i)
        assert not polled(w, clock), "the same text, churned, is no change"
    path.write_text("interval: 200ms\n")
    reloads = []
    for i in range(4, 10):
        churned(path, how, i)
        reloads.append(polled(w, clock))
    assert reloads.count(True) == 1 and True in reloads[:2], reloads


def test_an_mtime_in_the_future_does_not_make_every_poll_read_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An mtime ahead of the clock (clock skew, `touch -d`, a copy that kept its mtime) is not a recent one: no write
    from now on can share its tick, so the watch goes by the stat alone, and an edit (a new mtime) still reloads."""
    path, clock = tmp_path / "c.yaml", Clock()
    path.write_text("interval: 100ms\n")
    future = time.time_ns() + 86_400 * 1_000_000_000
    os.utime(path, ns=(future, future))
    reads: list[str] = []
    digest = configwatch._digest
    monkeypatch.setattr(configwatch, "_digest", lambda p: reads.append(p) or digest(p))
    w = watch(path, clock)
    reads.clear()
    for _ in range(5):
        assert not polled(w, clock)
    assert reads == [], "the unchanged file is not read at every poll"
    path.write_text("interval: 200ms\n")
    assert settled(w, clock) and not polled(w, clock)


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
    stats: list[str] = []  # one per stat() the watch takes: a poll past its interval, or a reload's seen()
    identity = configwatch._identity
    monkeypatch.setattr(configwatch, "_identity", lambda p: stats.append(p) or identity(p))
    a = Agent(config.load(str(path)), HostFS(tmp_path), str(path), gpu=NoGpu())
    with AgentThread(a, timeout=5):
        path.write_text("interval: 30ms\n" + base)
        wait_for(lambda: a.stats.reloads_ok == 1)
        assert a.config.interval == pytest.approx(0.03)
        path.write_text("interval: fast\n" + base)
        wait_for(lambda: a.stats.reloads_failed == 1)
        assert a.config.interval == pytest.approx(0.03) and "interval" in a.stats.last_reload_error
        done = len(stats)
        wait_for(lambda: len(stats) >= done + 3)  # three polls: two would act on a change
        assert a.stats.reloads_failed == 1, "the same bad text is not tried again"
        path.write_text("interval: 40ms\nlatency: {enabled: false}\nconfig_watch: {enabled: false}\n")
        wait_for(lambda: a.stats.reloads_ok == 2)
        path.write_text("interval: 50ms\n" + base)
        ticks = a.stats.ticks
        wait_for(lambda: a.stats.ticks >= ticks + 10)  # 400 ms of 40 ms ticks: a watch still on would act within 200
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
