"""cgroup v2 plumbing for programs attached per cgroup: where the hierarchy is, which directory a cgroup id names,
and BPF links that hold the attachments.

BPF reports a cgroup as bpf_get_current_cgroup_id(); on cgroup2 that id is the inode number of the cgroup's
directory, so the way back to a path is a walk of the hierarchy.
"""

from __future__ import annotations

import os
import posixpath
import time
from typing import Callable

from qosagent.ebpf.libbpf import link_create
from qosagent.features import mount_types
from qosagent.hostfs import HostFS

# Where systemd puts the unified hierarchy: the whole of /sys/fs/cgroup on unified hosts, a subdirectory on hybrid.
_PREFERRED_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def cgroup2_mount(fs: HostFS) -> str | None:
    """The host path of a cgroup2 mount, or None where the host has no cgroup v2 hierarchy."""
    # Under --host-root (a DaemonSet with hostPID) the host's own mount table, PID 1's: the container's view of
    # /sys/fs/cgroup may be a cgroup namespace of its own, and the paths must be the host's, under the host root.
    on_host = str(fs.root) == "/"
    mounts = mount_types(fs) if on_host else (mount_types(fs, "1") or mount_types(fs))
    found = [point for point, fstype in mounts.items() if fstype == "cgroup2"]
    for point in _PREFERRED_MOUNTS:
        if point in found:
            return point
    # Any other mount shows the same single hierarchy (cgroup2 has one), so the first one will do.
    return found[0] if found else None


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
            if self._inode(path) == cgid:
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

    def _inode(self, host_path: str) -> int | None:
        try:
            st = os.stat(self.fs.path(host_path), follow_symlinks=False)
        except OSError:
            return None
        return st.st_ino

    def _walk(self) -> dict[int, str]:
        out: dict[int, str] = {}
        root_ino = self._inode(self.root)
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


class CgroupLinks:
    """One program linked to any number of cgroup directories, each through its own BPF link.

    Links, never BPF_PROG_ATTACH: the kernel detaches a link when its last fd closes, so an agent that is killed
    leaves no program attached to the host's cgroups.
    """

    def __init__(self, prog_fd: int, attach_type: int, fs: HostFS):
        self.prog_fd = prog_fd
        self.attach_type = attach_type
        self.fs = fs
        self._links: dict[str, int] = {}

    @property
    def paths(self) -> list[str]:
        return sorted(self._links)

    def attach(self, path: str) -> bool:
        """Link the program to the cgroup at host path; False when it is linked there already."""
        path = posixpath.normpath(path)
        if path in self._links:
            return False
        try:
            dir_fd = os.open(self.fs.path(path), os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise OSError(e.errno, f"open cgroup {path}: {e.strerror}") from e
        try:
            # The link holds its own reference on the cgroup, so the directory fd is needed only for the call.
            self._links[path] = link_create(self.prog_fd, dir_fd, self.attach_type)
        except OSError as e:
            raise OSError(e.errno, f"BPF link to cgroup {path} (attach type {self.attach_type}): {e.strerror}") from e
        finally:
            os.close(dir_fd)
        return True

    def detach(self, path: str) -> None:
        fd = self._links.pop(posixpath.normpath(path), None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for path in list(self._links):
            self.detach(path)
