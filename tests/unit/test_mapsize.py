"""Map memory worked out before the maps exist (`qosagent check`), and the flow front sized from the config and the
CPU count rather than from the CPU count alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from qosagent.config import parse
from qosagent.ebpf import mapsize
from qosagent.hostfs import HostFS
from qosagent.quota.datapath import flow_l1_bits, map_sizes


def test_possible_cpus_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/possible").write_text("0-383\n")
    assert mapsize.possible_cpus(HostFS(str(tmp_path))) == 384
    (tmp_path / "sys/devices/system/cpu/possible").write_text("0\n")
    assert mapsize.possible_cpus(HostFS(str(tmp_path))) == 1


def test_possible_cpus_fallback_is_present_then_online_and_warned_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Online CPUs 0-3 but CPUs up to 7 present: the online count would fold CPUs 4-7 onto 0-3's generation lines.
    monkeypatch.setattr(mapsize, "_fallback_warned", False)
    monkeypatch.setattr(mapsize.os, "cpu_count", lambda: 4)
    cpu = tmp_path / "sys/devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "present").write_text("0-3,6-7\n")
    (cpu / "possible").write_text("garbage\n")
    fs = HostFS(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="qosagent.ebpf"):
        assert mapsize.possible_cpus(fs) == 8
        assert mapsize.possible_cpus(fs) == 8
        (cpu / "present").unlink()
        assert mapsize.possible_cpus(fs) == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "possible unreadable" in warnings[0].getMessage()
    assert "8 CPUs (the highest present CPU + 1)" in warnings[0].getMessage()
    # Readable again: the file, and no further warning.
    (cpu / "possible").write_text("0-15\n")
    with caplog.at_level(logging.WARNING, logger="qosagent.ebpf"):
        assert mapsize.possible_cpus(fs) == 16
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_possible_cpus_fallback_to_online_count_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(mapsize, "_fallback_warned", False)
    monkeypatch.setattr(mapsize.os, "cpu_count", lambda: 3)
    with caplog.at_level(logging.WARNING, logger="qosagent.ebpf"):
        assert mapsize.possible_cpus(HostFS(str(tmp_path))) == 3
    assert [r.getMessage() for r in caplog.records if "the online CPU count" in r.getMessage()]


def test_per_entry_costs_as_the_kernel_accounts_them() -> None:
    # memlock of maps made on 6.18: a 2048-entry hash of 16-byte keys and 64-byte values took 144 B per entry, a
    # per-CPU array of 8-byte values 8 + 8 per CPU.
    assert mapsize.MapSize("h", mapsize.HASH, 2048, 16, 64).bytes(2) == 2048 * 144
    assert mapsize.MapSize("p", mapsize.PERCPU_ARRAY, 1024, 4, 8).bytes(2) == 1024 * 24
    assert mapsize.MapSize("a", mapsize.ARRAY, 10, 4, 5).bytes(2) == 80


def test_the_flow_front_follows_the_flow_cache_not_the_cpu_count() -> None:
    assert flow_l1_bits(65536, 2) == 12  # capped: 4096 entries per CPU, as before
    assert flow_l1_bits(65536, 384) == 8  # 256 per CPU: each CPU's share of the cache
    assert flow_l1_bits(1024, 384) == 6  # the floor
    cfg = parse({"quota": {"enabled": True}}, "test")
    front = {m.name: m for m in map_sizes(cfg, 384)}["quota_flow_l1"]
    # ~75 MB on a 384-thread host when the front was 4096 entries per CPU; now ~4.7 MB.
    assert front.bytes(384) < 5 * 2**20 < mapsize.MapSize("old", mapsize.PERCPU_ARRAY, 4096, 4, 48).bytes(384) / 10
