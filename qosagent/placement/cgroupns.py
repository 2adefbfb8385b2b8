"""Cgroup paths as the host names them, whatever cgroup namespace the agent runs in.

The kernel writes /proc/PID/cgroup relative to the *reader's* cgroup namespace. An agent in a container's own
namespace (a DaemonSet pod: hostPID, but the runtime's private cgroupns) reads a pod's process as
`/../../kubepods-…`, so `/kubepods.slice/…` selectors and the kubelet's cpusets would be missed. Setting the host's
namespace (setns) needs CAP_SYS_ADMIN, which the agent does not hold; instead each path is rebased on where the
agent's own namespace root sits in the host's tree. That root is found once per hierarchy: host PID 1 is outside
the agent's namespace, so the `..` that lead its path say how deep the root lies, and of the host's cgroups at that
depth the root is the one where the agent's own pid is found at the agent's own (relative) path.
"""

from __future__ import annotations

import logging
import os
import posixpath

from qosagent.hostfs import HostFS

log = logging.getLogger("qosagent.placement")

KINDS = ("v2", "cpuset", "systemd")  # the order of discovery.cgroup_paths()


def _mount(fs: HostFS, kind: str) -> str | None:
    """Where a hierarchy is mounted below the host root (the host's own view: its namespace root)."""
    if kind == "v2":
        for m in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
            if fs.exists(f"{m}/cgroup.controllers"):
                return m
        return None
    m = f"/sys/fs/cgroup/{kind}"
    return m if fs.exists(f"{m}/cgroup.procs") else None


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
        from qosagent.placement.discovery import cgroup_paths

        self.fs = fs
        self.pid = pid if pid is not None else os.getpid()
        self.own = dict(zip(KINDS, cgroup_paths(fs.try_read(f"/proc/{self.pid}/cgroup") or "")))
        self.init = dict(zip(KINDS, cgroup_paths(fs.try_read("/proc/1/cgroup") or "")))
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

    def _find_root(self, kind: str) -> str | None:
        mount = _mount(self.fs, kind)
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
