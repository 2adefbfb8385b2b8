"""BPF links that hold a program's attachments to cgroups (where the cgroups are, and which one an id names, is
qosagent/cgroups.py's)."""

from __future__ import annotations

import os
import posixpath

from qosagent.ebpf.libbpf import link_create
from qosagent.hostfs import HostFS


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
