"""The host's cgroups, read through HostFS: where each hierarchy is, a process's cgroup paths as the host names them
(whatever cgroup namespace the agent runs in), a controller's files for cgroup v2 and v1 alike, and the way back
from a cgroup id to its directory.

Hosts differ in layout: unified (cgroup v2 on /sys/fs/cgroup, every controller there), hybrid (v1 controllers under
/sys/fs/cgroup/<name>, a controller-less cgroup2 on /sys/fs/cgroup/unified: systemd's hybrid mode, this project's
build host) and legacy (v1 only). A controller file is looked for in both versions, v2 first, so callers need not
know which one the host has.

Host-view resolution: the kernel writes /proc/PID/cgroup relative to the *reader's* cgroup namespace. An agent in a
container's own namespace (a DaemonSet pod: hostPID, but the runtime's private cgroupns) reads a pod's process as
`/../../kubepods-…`, so `/kubepods.slice/…` selectors and the kubelet's cpusets would be missed. Setting the host's
namespace (setns) needs CAP_SYS_ADMIN, which the agent does not hold; instead each path is rebased on where the
agent's own namespace root sits in the host's tree. That root is found once per hierarchy: host PID 1 is outside
the agent's namespace, so the `..` that lead its path say how deep the root lies, and of the host's cgroups at that
depth the root is the one where the agent's own pid is found at the agent's own (relative) path.

Cgroup ids: BPF reports a cgroup as bpf_get_current_cgroup_id(); on cgroup2 that id is the inode number of the
cgroup's directory, so the way back to a path is a walk of the hierarchy (CgroupIndex).
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from typing import Callable

from qosagent.cpulist import parse_cpulist
from qosagent.hostfs import HostFS, mount_types

log = logging.getLogger("qosagent.cgroups")

# Where systemd puts the unified hierarchy: the whole of /sys/fs/cgroup on unified hosts, a subdirectory on hybrid
# ones. The one list of places every reader of cgroup v2 tries, in this order.
V2_PLACES = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
# Where v1 hierarchies are, one directory per controller (or per named hierarchy: systemd's is `systemd`).
V1_ROOT = "/sys/fs/cgroup"

V2 = "v2"  # the kind of the unified hierarchy; v1 hierarchies are named by controller ("cpuset") or name ("systemd")
KINDS = (V2, "cpuset", "systemd")  # the order of cgroup_paths()


# ---- where the hierarchies are -------------------------------------------------------------------------------

def cgroup2_mount(fs: HostFS) -> str | None:
    """The host path of a cgroup2 mount, by the mount table, or None where the host has no cgroup v2 hierarchy."""
    # Under --host-root (a DaemonSet with hostPID) the host's own mount table, PID 1's: the container's view of
    # /sys/fs/cgroup may be a cgroup namespace of its own, and the paths must be the host's, under the host root.
    on_host = str(fs.root) == "/"
    mounts = mount_types(fs) if on_host else (mount_types(fs, "1") or mount_types(fs))
    found = [point for point, fstype in mounts.items() if fstype == "cgroup2"]
    for point in V2_PLACES:
        if point in found:
            return point
    # Any other mount shows the same single hierarchy (cgroup2 has one), so the first one will do.
    return found[0] if found else None


def cgroup2_mount_target(fs: HostFS, mounts: dict[str, str]) -> str | None:
    """Where to mount the cgroup v2 hierarchy when no cgroup2 mount is visible (`ip netns exec` gives a fresh /sys
    without it): where systemd would, /sys/fs/cgroup on a bare /sys, else its hybrid place if that directory exists.
    Never over a mount (a cgroup v1 host's tmpfs stays as it is); None when there is nothing to mount."""
    if "cgroup2" in mounts.values():
        return None
    for point in V2_PLACES:
        if point not in mounts and fs.is_dir(point):
            return point
    return None


def hierarchy(fs: HostFS, kind: str) -> str | None:
    """Where a hierarchy's root is below the host root, by its files (a fixture tree or a host root has no mount
    table of its own): the unified one's has cgroup.controllers, a v1 one's cgroup.procs."""
    if kind == V2:
        for m in V2_PLACES:
            if fs.exists(f"{m}/cgroup.controllers"):
                return m
        return None
    m = f"{V1_ROOT}/{kind}"
    return m if fs.exists(f"{m}/cgroup.procs") else None


def controller_version(fs: HostFS, controller: str) -> str | None:
    """Where a controller is: V2 where the unified hierarchy offers it, "v1" where it is mounted as a v1
    hierarchy of its own (hybrid and legacy hosts), None where neither."""
    root = hierarchy(fs, V2)
    if root is not None and controller in (fs.try_read(f"{root}/cgroup.controllers") or "").split():
        return V2
    return "v1" if hierarchy(fs, controller) is not None else None


def cgroup_dir(fs: HostFS, version: str, controller: str, path: str) -> str | None:
    """The host directory of a cgroup, by its path in the hierarchy the controller is in (None: not mounted)."""
    base = hierarchy(fs, V2 if version == V2 else controller)
    if base is None:
        return None
    return posixpath.join(base, path.lstrip("/")) if path.strip("/") else base


def cgroup_procs(fs: HostFS, directory: str) -> list[int] | None:
    """The processes of a cgroup (None: the cgroup is gone)."""
    text = fs.try_read(f"{directory}/cgroup.procs")
    if text is None:
        return None
    return [int(p) for p in text.split() if p.isdigit()]


def flat_keyed(text: str | None) -> dict[str, int]:
    """A flat-keyed controller file (cpu.stat, memory.events): key -> value; {} when unreadable."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = int(v)
        except ValueError:
            continue
    return out


# ---- a process's cgroups -------------------------------------------------------------------------------------

def parse_proc_cgroup(text: str) -> dict[str, str]:
    """kind -> path from /proc/PID/cgroup: V2 for the unified hierarchy, each controller of a v1 hierarchy
    (`cpu,cpuacct` gives both), and a named one by its name (`name=systemd` gives `systemd`)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            out[V2] = path
            continue
        for c in controllers.split(","):
            if c:
                out[c.removeprefix("name=")] = path
    return out


def cgroup_paths(text: str) -> tuple[str, str, str]:
    """(v2 path, v1 cpuset path, v1 systemd path) from /proc/PID/cgroup ("" where the host has none)."""
    found = parse_proc_cgroup(text)
    return found.get(V2, ""), found.get("cpuset", ""), found.get("systemd", "")


def controller_files(controller: str, v2: str, v1: str, v2_file: str, v1_file: str) -> list[str]:
    """Host paths where a controller's file of a cgroup may be, the cgroup's own first, then each ancestor's (a
    cgroup where the controller is not enabled inherits its parent's values): under each place of the v2 hierarchy
    for the cgroup's v2 path, then under the controller's v1 hierarchy for its v1 path (the v1 root's own file even
    where the process has no v1 path)."""
    out: list[str] = []
    for base, path, leaf in [(b, v2, v2_file) for b in V2_PLACES if v2] + [(f"{V1_ROOT}/{controller}", v1, v1_file)]:
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts), -1, -1):
            out.append(posixpath.join(base, *parts[:i], leaf))
    return out


def read_controller(fs: HostFS, controller: str, v2: str, v1: str, v2_file: str, v1_file: str) -> str | None:
    """The first non-empty of controller_files(), or None where none can be read."""
    for path in controller_files(controller, v2, v1, v2_file, v1_file):
        text = fs.try_read(path)
        if text:
            return text
    return None


def read_cpuset(fs: HostFS, v2: str, v1: str) -> frozenset[int] | None:
    """The CPUs a process's cgroup allows (the kubelet's decision), None when unreadable."""
    text = read_controller(fs, "cpuset", v2, v1, "cpuset.cpus.effective", "cpuset.effective_cpus")
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        return None


def _ups(path: str) -> int:
    n = 0
    for part in path.split("/")[1:]:
        if part != "..":
            break
        n += 1
    return n


class HostCgroups:
    """Maps cgroup paths read from /proc (in the agent's namespace) to the host's; identity in the host's namespace.
    `pid` is the agent's own pid as the host's /proc numbers it (hostPID)."""

    def __init__(self, fs: HostFS, pid: int | None = None):
        self.fs = fs
        self.pid = pid if pid is not None else os.getpid()
        self.own = parse_proc_cgroup(fs.try_read(f"/proc/{self.pid}/cgroup") or "")
        self.init = parse_proc_cgroup(fs.try_read("/proc/1/cgroup") or "")
        self.roots: dict[str, str | None] = {}
        self.unresolved: set[str] = set()  # hierarchies whose namespace root was not found (paths left as read)

    def host(self, kind: str, path: str) -> str:
        if not path or not self.init.get(kind, "").startswith("/.."):
            return path
        if kind not in self.roots:
            self.roots[kind] = self._find_root(kind)
        root = self.roots[kind]
        if root is None:
            return path
        return posixpath.normpath(f"{root}/{path.lstrip('/')}")

    def of_pid(self, pid: int) -> tuple[str, str, str]:
        """A process's (v2, cpuset, systemd) paths as the host names them ("" where it has none or has exited)."""
        v2, cpuset, systemd = cgroup_paths(self.fs.try_read(f"/proc/{pid}/cgroup") or "")
        return self.host(V2, v2), self.host("cpuset", cpuset), self.host("systemd", systemd)

    def of_pid_kinds(self, pid: int, kinds: tuple[str, ...]) -> dict[str, str] | None:
        """A process's paths in the hierarchies of `kinds` (V2 or v1 controllers) as the host names them, those it
        has; None when it has exited."""
        text = self.fs.try_read(f"/proc/{pid}/cgroup")
        if text is None:
            return None
        found = parse_proc_cgroup(text)
        return {k: self.host(k, found[k]) for k in kinds if found.get(k)}

    def _find_root(self, kind: str) -> str | None:
        mount = hierarchy(self.fs, kind)
        depth = _ups(self.init[kind])
        own = self.own.get(kind, "")
        level = [""]
        for _ in range(depth):
            level = [f"{d}/{n}" for d in level for n in self.fs.listdir(f"{mount}{d}")
                     if self.fs.is_dir(f"{mount}{d}/{n}")] if mount else []
        for cand in level:
            procs = self.fs.try_read(f"{mount}{cand}{own.rstrip('/')}/cgroup.procs") or ""
            if str(self.pid) in procs.split():
                log.info("cgroup namespace: the agent's %s root is %s on the host", kind, cand)
                return cand
        self.unresolved.add(kind)
        log.warning("cgroup namespace: cannot place the agent's %s root in the host's tree (%s): cgroup paths of "
                    "other namespaces stay as read, and selectors by cgroup may not match them", kind,
                    mount or "hierarchy not mounted under the host root")
        return None


# ---- cgroup ids ----------------------------------------------------------------------------------------------

def cgroup_id(fs: HostFS, host_path: str) -> int | None:
    """A cgroup2 directory's id as the kernel reports it (its inode number), None when it is gone."""
    try:
        return os.stat(fs.path(host_path), follow_symlinks=False).st_ino
    except OSError:
        return None


class CgroupIndex:
    """cgroup id -> host path of its directory under root, from a cached walk that repeats only on a miss."""

    def __init__(self, fs: HostFS, root: str, rewalk_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.rewalk_s = rewalk_s
        self.clock = clock
        self._paths: dict[int, str] = {}
        self._walked_at: float | None = None

    def path_of(self, cgid: int) -> str | None:
        path = self._paths.get(cgid)
        if path is not None:
            if cgroup_id(self.fs, path) == cgid:
                return path
            # Removed, or removed and a new cgroup made under the same name: the id no longer names this path.
            del self._paths[cgid]
        now = self.clock()
        # Ids of short-lived cgroups (one per job or exec) can keep missing; without a limit each tick would walk
        # a tree of thousands of directories again.
        if self._walked_at is not None and now - self._walked_at < self.rewalk_s:
            return None
        self._walked_at = now
        self._paths = self._walk()
        return self._paths.get(cgid)

    def _walk(self) -> dict[int, str]:
        out: dict[int, str] = {}
        root_ino = cgroup_id(self.fs, self.root)
        if root_ino is None:
            return out
        out[root_ino] = self.root
        stack = [self.root]
        while stack:
            host_dir = stack.pop()
            try:
                with os.scandir(self.fs.path(host_dir)) as it:
                    for entry in it:
                        # Symlinks are skipped: cgroupfs has none, and following one could leave the hierarchy.
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        child = posixpath.join(host_dir, entry.name)
                        # stat(), not the readdir inode: on stacked filesystems the two can differ, and path_of
                        # checks hits against stat().
                        out[entry.stat(follow_symlinks=False).st_ino] = child
                        stack.append(child)
            except OSError:
                # A cgroup removed during the walk: its subtree is gone too, nothing to index.
                continue
        return out
