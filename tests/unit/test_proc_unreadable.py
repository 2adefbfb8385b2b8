"""Another process's /proc entry the kernel refuses (EACCES, EPERM: a sandbox without CAP_SYS_PTRACE or
CAP_DAC_READ_SEARCH) is counted and said once, never taken for a process gone (ENOENT, ESRCH), which is not counted:
the serving-namespace scan (/proc/PID/ns/net) and the socket holders (/proc/PID/fd), on fixture trees whose links
raise as the kernel would."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from qosagent import listeners, netns
from qosagent.hostfs import HostFS
from tests.unit.test_listeners import proc as fd_proc
from tests.unit.test_netns_pure import TCP, fake_proc


def raising(monkeypatch: pytest.MonkeyPatch, name: str, errors: dict[str, int]) -> None:
    """os.<name> raising OSError(errno) for a path ending in one of `errors`, as the kernel's check would."""
    real = getattr(os, name)

    def fake(path, *args, **kwargs):
        for tail, err in errors.items():
            if str(path).endswith(tail):
                raise OSError(err, os.strerror(err), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, fake)


def test_a_refused_namespace_link_is_counted_and_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    fake_proc(tmp_path, 1, "host", TCP, "init")
    fake_proc(tmp_path, 10, "a", TCP, "vllm serve")
    fake_proc(tmp_path, 20, "b", TCP, "vllm serve")  # another container's: refused
    fake_proc(tmp_path, 30, "c", TCP, "vllm serve")  # exited while listed
    fake_proc(tmp_path, 40, "d", TCP, "vllm serve")  # refused by an LSM (EPERM)
    raising(monkeypatch, "readlink", {"/20/ns/net": errno.EACCES, "/30/ns/net": errno.ENOENT,
                                      "/40/ns/net": errno.EPERM})
    fs = HostFS(tmp_path)
    own = (tmp_path / "ns" / "host").stat().st_ino
    with caplog.at_level(logging.WARNING, logger="qosagent.hostfs"):
        found = netns.serving_namespaces(fs, [8000], own, False)
        assert [ns.pid for ns in found.values()] == [10]
        assert fs.unreadable == {"ns_net": 2, "fd": 0}
        netns.serving_namespaces(fs, [8000], own, False)
    assert fs.unreadable == {"ns_net": 4, "fd": 0}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "/proc/20/ns/net refused" in said and "CAP_SYS_PTRACE" in said
    assert "qosagent_proc_unreadable_total{what='ns_net'}" in said


def test_refused_fds_are_counted_a_gone_process_is_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    for pid, socks in ((100, (5001,)), (200, (5002,)), (300, (5002,)), (400, (5002,))):
        fd_proc(tmp_path, pid, socks)
    # 200: another user's fd directory (mode 0500); 300: exited; 400: one link refused (no CAP_SYS_PTRACE).
    raising(monkeypatch, "listdir", {"/200/fd": errno.EACCES, "/300/fd": errno.ENOENT})
    raising(monkeypatch, "readlink", {"/400/fd/10": errno.EACCES})
    fs = HostFS(tmp_path)
    with caplog.at_level(logging.WARNING, logger="qosagent.hostfs"):
        assert listeners.holders(fs, [5001, 5002], [100, 200, 300, 400], every=True) == {5001: [100]}
    assert fs.unreadable == {"ns_net": 0, "fd": 2}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "/proc/200/fd refused" in said and "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH" in said
    # Other directories read as before: nothing counted.
    assert fs.listdir("/proc/999") == [] and fs.unreadable["fd"] == 2


def test_a_refused_namespace_has_no_veth_and_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_proc(tmp_path, 20, "b", TCP, "vllm serve")
    raising(monkeypatch, "open", {"/20/ns/net": errno.EACCES})
    fs = HostFS(tmp_path)
    ns = netns.ServingNs(ino=1, pid=20, ports=frozenset({8000}))
    assert netns.host_veths(None, [], fs, ns) == []  # type: ignore[arg-type]
    assert fs.unreadable["ns_net"] == 1
