from __future__ import annotations

import errno

import pytest

from qosagent.hostfs import HostFS, HostFSError


def test_reads_go_through_the_root(node_exporter_sysfs) -> None:
    fs = HostFS(node_exporter_sysfs)
    assert fs.read_text("/sys/class/thermal/thermal_zone0/type")
    assert "cpufreq" in fs.listdir("/sys/devices/system/cpu/cpu0")
    assert fs.try_read("/sys/does/not/exist") is None
    with pytest.raises(HostFSError) as ei:
        fs.read_text("/sys/does/not/exist")
    assert ei.value.errno == errno.ENOENT and ei.value.host_path == "/sys/does/not/exist"


def test_symlinks_resolve_inside_the_root(node_exporter_sysfs) -> None:
    fs = HostFS(node_exporter_sysfs)
    real = fs.realpath("/sys/class/hwmon/hwmon0")
    assert real.startswith("/sys/devices/")


def test_write_and_read_int(tmp_path) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys" / "knob").write_text("10\n")
    fs = HostFS(tmp_path)
    fs.write_text("/sys/knob", "42")
    assert fs.read_int("/sys/knob") == 42
    (tmp_path / "sys" / "knob").write_text("x")
    with pytest.raises(HostFSError) as ei:
        fs.read_int("/sys/knob")
    assert ei.value.errno == errno.EINVAL


def test_relative_paths_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError):
        HostFS(tmp_path).path("sys/x")
