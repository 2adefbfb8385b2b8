"""The cgroups room on plain directory trees (inode numbers and mount tables work the same on any fs), in each
layout a host may have: unified (cgroup v2 only), hybrid (v1 controllers, a controller-less cgroup2 at
/sys/fs/cgroup/unified, as on the build host) and legacy (v1 only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qosagent.cgroups import (
    CgroupIndex,
    HostCgroups,
    cgroup2_mount,
    cgroup2_mount_target,
    cgroup_paths,
    controller_files,
    hierarchy,
    parse_proc_cgroup,
    read_controller,
    read_cpuset,
)
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


# ---- the three layouts -----------------------------------------------------------------------------------------

PROC_UNIFIED = "0::/kubepods.slice/pod1/ctr-a\n"
PROC_HYBRID = """\
12:cpuset:/kubepods/pod1/ctr-a
11:cpu,cpuacct:/kubepods/pod1/ctr-a
4:memory:/kubepods/pod1/ctr-a
1:name=systemd:/system.slice/containerd.service
0::/system.slice/containerd.service
"""
PROC_LEGACY = "\n".join(line for line in PROC_HYBRID.splitlines() if not line.startswith("0::")) + "\n"


def test_a_process_cgroup_file_names_each_hierarchy_by_kind() -> None:
    assert parse_proc_cgroup(PROC_UNIFIED) == {"v2": "/kubepods.slice/pod1/ctr-a"}
    assert parse_proc_cgroup(PROC_HYBRID) == {
        "cpuset": "/kubepods/pod1/ctr-a", "cpu": "/kubepods/pod1/ctr-a", "cpuacct": "/kubepods/pod1/ctr-a",
        "memory": "/kubepods/pod1/ctr-a", "systemd": "/system.slice/containerd.service",
        "v2": "/system.slice/containerd.service"}
    assert cgroup_paths(PROC_UNIFIED) == ("/kubepods.slice/pod1/ctr-a", "", "")
    assert cgroup_paths(PROC_HYBRID) == ("/system.slice/containerd.service", "/kubepods/pod1/ctr-a",
                                         "/system.slice/containerd.service")
    assert cgroup_paths(PROC_LEGACY) == ("", "/kubepods/pod1/ctr-a", "/system.slice/containerd.service")
    assert cgroup_paths("") == ("", "", "")


def put(root: Path, host_path: str, text: str = "") -> None:
    p = root / host_path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def layout(root: Path, kind: str) -> HostFS:
    """The hierarchies' roots as each layout has them, with the cpuset files a kubelet's pod cgroup would have."""
    if kind == "unified":
        put(root, "/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
        put(root, "/sys/fs/cgroup/cpuset.cpus.effective", "0-7\n")
        put(root, "/sys/fs/cgroup/kubepods.slice/pod1/cpuset.cpus.effective", "2-3\n")
        # The container's own cgroup has no cpuset enabled: it inherits the pod's.
        put(root, "/sys/fs/cgroup/kubepods.slice/pod1/ctr-a/cgroup.procs", "77\n")
    else:
        if kind == "hybrid":
            put(root, "/sys/fs/cgroup/unified/cgroup.controllers", "")  # no controllers on the unified side
            put(root, "/sys/fs/cgroup/unified/system.slice/containerd.service/cgroup.procs", "77\n")
        for name in ("cpuset", "cpu", "memory", "systemd"):
            put(root, f"/sys/fs/cgroup/{name}/cgroup.procs", "1\n")
        put(root, "/sys/fs/cgroup/cpuset/cpuset.effective_cpus", "0-7\n")
        put(root, "/sys/fs/cgroup/cpuset/kubepods/pod1/ctr-a/cpuset.effective_cpus", "4\n")
    return HostFS(root)


@pytest.mark.parametrize("kind,v2,cpuset", [
    ("unified", "/sys/fs/cgroup", None),
    ("hybrid", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/cpuset"),
    ("legacy", None, "/sys/fs/cgroup/cpuset"),
])
def test_hierarchies_are_found_by_their_files_in_each_layout(tmp_path: Path, kind: str, v2: str | None,
                                                            cpuset: str | None) -> None:
    fs = layout(tmp_path, kind)
    assert hierarchy(fs, "v2") == v2
    assert hierarchy(fs, "cpuset") == cpuset
    assert hierarchy(fs, "blkio") is None


@pytest.mark.parametrize("kind,proc,want", [
    ("unified", PROC_UNIFIED, {2, 3}),  # inherited from the pod's cgroup
    ("hybrid", PROC_HYBRID, {4}),  # the unified side has no cpuset: v1's
    ("legacy", PROC_LEGACY, {4}),
])
def test_a_controller_file_is_read_from_v2_or_v1_whichever_the_host_has(tmp_path: Path, kind: str, proc: str,
                                                                       want: set[int]) -> None:
    fs = layout(tmp_path, kind)
    v2, v1, _ = cgroup_paths(proc)
    assert read_cpuset(fs, v2, v1) == want
    assert read_controller(fs, "memory", v2, v1, "memory.max", "memory.limit_in_bytes") is None


def test_controller_files_go_from_the_cgroup_up_v2_places_first_then_v1() -> None:
    assert controller_files("cpuset", "/a/b", "/c", "cpuset.cpus.effective", "cpuset.effective_cpus") == [
        "/sys/fs/cgroup/a/b/cpuset.cpus.effective", "/sys/fs/cgroup/a/cpuset.cpus.effective",
        "/sys/fs/cgroup/cpuset.cpus.effective",
        "/sys/fs/cgroup/unified/a/b/cpuset.cpus.effective", "/sys/fs/cgroup/unified/a/cpuset.cpus.effective",
        "/sys/fs/cgroup/unified/cpuset.cpus.effective",
        "/sys/fs/cgroup/cpuset/c/cpuset.effective_cpus", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"]
    # No v2 path (a legacy host): v1 only, its root's file even without a v1 path.
    assert controller_files("memory", "", "", "memory.max", "memory.limit_in_bytes") == [
        "/sys/fs/cgroup/memory/memory.limit_in_bytes"]


def test_unparsable_cpuset_is_unknown(tmp_path: Path) -> None:
    fs = layout(tmp_path, "unified")
    put(tmp_path, "/sys/fs/cgroup/kubepods.slice/pod1/cpuset.cpus.effective", "garbage\n")
    assert read_cpuset(fs, "/kubepods.slice/pod1/ctr-a", "") is None


@pytest.mark.parametrize("mounts,dirs,want", [
    # `ip netns exec`: a fresh sysfs without any cgroup mount; systemd's unified place.
    ({"/sys": "sysfs"}, ["/sys/fs/cgroup"], "/sys/fs/cgroup"),
    # A v1 host: /sys/fs/cgroup is a tmpfs of v1 hierarchies, never mounted over; the hybrid place if it is there.
    ({"/sys/fs/cgroup": "tmpfs"}, ["/sys/fs/cgroup/unified"], "/sys/fs/cgroup/unified"),
    ({"/sys/fs/cgroup": "tmpfs"}, ["/sys/fs/cgroup"], None),
    # Mounted somewhere already: nothing to do.
    ({"/sys/fs/cgroup/unified": "cgroup2"}, ["/sys/fs/cgroup"], None),
    ({}, [], None),
])
def test_where_a_missing_cgroup2_would_be_mounted(tmp_path: Path, mounts: dict[str, str], dirs: list[str],
                                                  want: str | None) -> None:
    for d in dirs:
        (tmp_path / d.lstrip("/")).mkdir(parents=True)
    assert cgroup2_mount_target(HostFS(tmp_path), mounts) == want


def test_v1_paths_from_a_container_namespace_are_rebased_per_hierarchy(tmp_path: Path) -> None:
    """Hybrid host, the agent in a cgroup namespace of its own: its cpuset root is found in the v1 tree, and a pod's
    paths as it reads them come out as the host's."""
    fs = layout(tmp_path, "hybrid")
    agent_cg = "/kubepods/podagent/ctr-q"
    put(tmp_path, f"/sys/fs/cgroup/cpuset{agent_cg}/cgroup.procs", "4242\n")
    put(tmp_path, "/proc/1/cgroup", "12:cpuset:/../../..\n1:name=systemd:/init.scope\n0::/init.scope\n")
    put(tmp_path, "/proc/4242/cgroup", "12:cpuset:/\n1:name=systemd:/system.slice/q.service\n0::/q\n")
    put(tmp_path, "/proc/77/cgroup", "12:cpuset:/../../pod1/ctr-a\n1:name=systemd:/s\n0::/s\n")
    hc = HostCgroups(fs, 4242)
    assert hc.of_pid(77) == ("/s", "/kubepods/pod1/ctr-a", "/s")  # only cpuset is namespaced here
    assert hc.roots == {"cpuset": agent_cg}
    assert hc.of_pid(99) == ("", "", "")  # exited
