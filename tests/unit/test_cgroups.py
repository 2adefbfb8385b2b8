"""CgroupIndex and cgroup2_mount on plain directory trees: inode numbers and mount tables work the same on any fs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qosagent.ebpf.cgroups import CgroupIndex, cgroup2_mount
from qosagent.hostfs import HostFS

ROOT = "/sys/fs/cgroup"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    base = tmp_path / ROOT.lstrip("/")
    for rel in ("system.slice/nginx.service", "kubepods.slice/pod1/ctr-a", "kubepods.slice/pod1/ctr-b"):
        (base / rel).mkdir(parents=True)
    (base / "cgroup.procs").write_text("")
    return tmp_path


def ino(root: Path, host_path: str) -> int:
    return os.stat(root / host_path.lstrip("/")).st_ino


def test_finds_nested_dirs_and_the_root(tree: Path) -> None:
    idx = CgroupIndex(HostFS(tree), ROOT, clock=Clock())
    for host in (ROOT, f"{ROOT}/system.slice/nginx.service", f"{ROOT}/kubepods.slice/pod1/ctr-b"):
        assert idx.path_of(ino(tree, host)) == host
    # A regular file's inode is no cgroup.
    assert idx.path_of(ino(tree, f"{ROOT}/cgroup.procs")) is None


def test_symlinked_dirs_are_not_followed(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tree / ROOT.lstrip("/") / "link").symlink_to(outside)
    idx = CgroupIndex(HostFS(tree), ROOT, clock=Clock())
    assert idx.path_of(outside.stat().st_ino) is None


def test_removed_dir_is_dropped_and_found_again_when_recreated(tree: Path) -> None:
    clock = Clock()
    idx = CgroupIndex(HostFS(tree), ROOT, rewalk_s=5.0, clock=clock)
    host = f"{ROOT}/kubepods.slice/pod1/ctr-a"
    old = ino(tree, host)
    assert idx.path_of(old) == host
    (tree / host.lstrip("/")).rmdir()
    # Gone: no longer answered, even from the cache (and the rate limit holds the re-walk back).
    assert idx.path_of(old) is None
    # A new cgroup under the same name is a new id; once the limit allows, a miss walks and finds it.
    (tree / host.lstrip("/")).mkdir()
    new = ino(tree, host)
    clock.now += 5.0
    assert idx.path_of(new) == host


def test_misses_walk_at_most_once_per_interval(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    idx = CgroupIndex(HostFS(tree), ROOT, rewalk_s=5.0, clock=clock)
    walks = []
    real_walk = idx._walk
    monkeypatch.setattr(idx, "_walk", lambda: walks.append(clock.now) or real_walk())
    assert idx.path_of(ino(tree, ROOT)) == ROOT
    assert len(walks) == 1
    late = f"{ROOT}/system.slice/late.service"
    (tree / late.lstrip("/")).mkdir()
    for unknown in range(10**9, 10**9 + 50):  # a burst of ids nobody has
        assert idx.path_of(unknown) is None
    assert idx.path_of(ino(tree, late)) is None  # not walked yet: inside the interval
    assert len(walks) == 1
    # Hits never walk, inside the interval or not.
    assert idx.path_of(ino(tree, f"{ROOT}/system.slice")) == f"{ROOT}/system.slice"
    clock.now += 4.9
    assert idx.path_of(ino(tree, late)) is None and len(walks) == 1
    clock.now += 0.1
    assert idx.path_of(ino(tree, late)) == late
    assert len(walks) == 2


def test_missing_root_is_empty_not_an_error(tmp_path: Path) -> None:
    idx = CgroupIndex(HostFS(tmp_path), "/sys/fs/cgroup/unified", clock=Clock())
    assert idx.path_of(1) is None


def write_mounts(tmp_path: Path, text: str) -> HostFS:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mounts").write_text(text)
    return HostFS(tmp_path)


UNIFIED = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
bpf /sys/fs/bpf bpf rw,nosuid,nodev,noexec,relatime,mode=700 0 0
"""

HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""

LEGACY = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
"""


@pytest.mark.parametrize("text,want", [
    (UNIFIED, "/sys/fs/cgroup"),
    (HYBRID, "/sys/fs/cgroup/unified"),
    (LEGACY, None),
    ("", None),
    # Elsewhere than systemd's places (a hand-made mount) still counts.
    ("cgroup2 /mnt/cg2 cgroup2 rw 0 0\n", "/mnt/cg2"),
    # The standard place wins over an extra mount of the same hierarchy.
    ("cgroup2 /mnt/cg2 cgroup2 rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", "/sys/fs/cgroup"),
])
def test_cgroup2_mount(tmp_path: Path, text: str, want: str | None) -> None:
    assert cgroup2_mount(write_mounts(tmp_path, text)) == want


def test_cgroup2_mount_without_a_mounts_file(tmp_path: Path) -> None:
    assert cgroup2_mount(HostFS(tmp_path)) is None


def test_cgroup2_mount_under_a_host_root_reads_the_hosts_table(tmp_path: Path) -> None:
    # A container's own table shows its (namespaced) view; under --host-root PID 1's table is the host's.
    fs = write_mounts(tmp_path, "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/mounts").write_text("cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    assert cgroup2_mount(fs) == "/sys/fs/cgroup/unified"
    (tmp_path / "proc/1/mounts").unlink()
    assert cgroup2_mount(fs) == "/sys/fs/cgroup"  # no PID 1 table to read (no hostPID): the own one
