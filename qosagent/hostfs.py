"""The one seam for /sys and /proc: every host file access goes through a HostFS rooted at --host-root.

A DaemonSet mounts the host at /host; tests root it at a fixture tree. Paths passed in are always the host's
absolute paths ("/sys/devices/system/cpu"), so code reads the same whatever the root.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("qosagent.hostfs")

# What each kind of another process's /proc entry needs beyond root, by the name it is counted under
# (qosagent_proc_unreadable_total{what}): the kernel's ptrace access check (PTRACE_MODE_READ_FSCREDS) guards both
# for a process of another user or with capabilities the agent lacks (every container's, every kernel thread's), and
# /proc/PID/fd is besides mode 0500, its owner's.
PROC_NEEDS = {"ns_net": "CAP_SYS_PTRACE", "fd": "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH"}
REFUSED = (errno.EACCES, errno.EPERM)


class HostFSError(OSError):
    """A host file could not be read or written; carries the host path and errno."""

    def __init__(self, err: int, message: str, host_path: str):
        super().__init__(err, message, host_path)
        self.host_path = host_path

    def __str__(self) -> str:
        return f"{self.host_path}: {self.strerror}"


class HostFS:
    def __init__(self, root: str | os.PathLike = "/"):
        self.root = Path(root).resolve()
        # Reads of other processes' /proc entries refused (not gone: ENOENT, ESRCH are a process that exited), by
        # PROC_NEEDS' name: a sandbox without the capability shows as a count and a warning, not as no pods and no
        # servers found.
        self.unreadable = dict.fromkeys(PROC_NEEDS, 0)
        self._unreadable_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HostFS({str(self.root)!r})"

    def path(self, host_path: str) -> Path:
        if not host_path.startswith("/"):
            raise ValueError(f"host paths are absolute: {host_path!r}")
        return self.root / host_path.lstrip("/")

    def _wrap(self, exc: OSError, host_path: str) -> HostFSError:
        return HostFSError(exc.errno or errno.EIO, exc.strerror or str(exc), host_path)

    def read_text(self, host_path: str) -> str:
        try:
            with open(self.path(host_path), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError as e:
            raise self._wrap(e, host_path) from e

    def read_int(self, host_path: str) -> int:
        text = self.read_text(host_path)
        try:
            return int(text)
        except ValueError:
            raise HostFSError(errno.EINVAL, f"not an integer: {text[:40]!r}", host_path) from None

    def try_read(self, host_path: str) -> str | None:
        """The file's text, or None when it is absent or unreadable (missing hardware is no data, not an error)."""
        try:
            return self.read_text(host_path)
        except HostFSError:
            return None

    def write_text(self, host_path: str, value: str) -> None:
        # sysfs wants one write() of the whole value, no newline needed. O_TRUNC is what `echo v > knob` does (sysfs
        # ignores it) and keeps a copied tree (--host-root rehearsals, fixtures) from keeping a longer old value's tail.
        try:
            fd = os.open(self.path(host_path), os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as e:
            raise self._wrap(e, host_path) from e

    def exists(self, host_path: str) -> bool:
        return self.path(host_path).exists()

    def is_dir(self, host_path: str) -> bool:
        return self.path(host_path).is_dir()

    def listdir(self, host_path: str, proc: str | None = None) -> list[str]:
        """The entries, sorted; [] when unreadable, counted as `proc` (a PROC_NEEDS name) when refused."""
        try:
            return sorted(os.listdir(self.path(host_path)))
        except OSError as e:
            if proc is not None:
                self.refused(proc, e, host_path)
            return []

    def glob(self, host_dir: str, pattern: str) -> list[str]:
        """Host paths of the entries of host_dir whose names match pattern (fnmatch), sorted."""
        base = host_dir.rstrip("/")
        return [f"{base}/{n}" for n in self.listdir(host_dir) if fnmatch.fnmatch(n, pattern)]

    def realpath(self, host_path: str) -> str:
        """Resolve symlinks inside the root (sysfs is full of them) and return the host path."""
        real = Path(os.path.realpath(self.path(host_path)))
        try:
            return "/" + str(real.relative_to(self.root))
        except ValueError:
            # An absolute link that points outside a fixture root: keep it as the host path it names.
            return str(real)

    def readlink(self, host_path: str, proc: str | None = None) -> str | None:
        """A symlink's target as written (/proc/<pid>/fd entries read `socket:[inode]`), or None when unreadable,
        counted as `proc` (a PROC_NEEDS name) when refused."""
        try:
            return os.readlink(self.path(host_path))
        except OSError as e:
            if proc is not None:
                self.refused(proc, e, host_path)
            return None

    def refused(self, what: str, e: OSError, host_path: str) -> None:
        """Count a failed read of another process's /proc entry `what` (a PROC_NEEDS name) when the kernel refused it,
        and say so the first time; a process that is gone is no refusal. Only on a failed read: the scans' reads that
        succeed cost nothing more."""
        if e.errno not in REFUSED:
            return
        with self._unreadable_lock:
            self.unreadable[what] += 1
            first = self.unreadable[what] == 1
        if first:
            log.warning("reading %s refused (%s): this agent lacks %s, so other users' and containers' processes "
                        "are not seen there (pods not followed, servers not found); counted in "
                        "qosagent_proc_unreadable_total{what=%r}", host_path, e.strerror, PROC_NEEDS[what], what)


def mount_types(fs: HostFS, pid: str = "self") -> dict[str, str]:
    """Mount point -> filesystem type in pid's mount namespace; a later mount on the same point shadows the earlier,
    as in the kernel."""
    text = fs.try_read(f"/proc/{pid}/mounts") or ""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out[parts[1]] = parts[2]
    return out
