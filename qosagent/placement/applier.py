"""The writes of placement: CPU affinity of every thread, migrate_pages(2), and the originals to put back.

Threads are listed through /proc/PID/task; a thread born while we set the others inherits its creator's mask,
which may still be the old one, so the listing is repeated until it brings no new thread. A process or thread that
exits halfway is an ordinary outcome (ESRCH), never an error.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from dataclasses import dataclass, field
from typing import Iterable

from qosagent import statefile
from qosagent.hostfs import HostFS
from qosagent.cpulist import format_cpulist, parse_cpulist
from qosagent.placement.discovery import numa_pages, proc_start

log = logging.getLogger("qosagent.placement")

# migrate_pages(2) has no libc wrapper in glibc; its number per architecture.
_SYS_MIGRATE_PAGES = {"x86_64": 256, "aarch64": 238, "ppc64le": 258, "s390x": 287}
_LISTING_PASSES = 4


class Exited(Exception):
    """The process is gone (or its pid now names another program)."""


@dataclass
class AffinityResult:
    threads: int = 0  # threads set
    vanished: int = 0  # threads that exited while we set them
    kept: int = 0  # threads already bound inside the target, left as they were


def _tids(fs: HostFS, pid: int) -> list[int]:
    return [int(t) for t in fs.listdir(f"/proc/{pid}/task") if t.isdigit()]


def set_affinity(fs: HostFS, pid: int, cpus: frozenset[int] | dict[int, frozenset[int]],
                 default: frozenset[int] | None = None, keep_subsets: bool = False) -> AffinityResult:
    """Give every thread of pid its CPUs: one set for all, or a per-thread map with `default` for the others.

    keep_subsets: a thread already bound inside its target (an OpenMP worker on one CPU) keeps its binding."""
    res = AffinityResult()
    done: set[int] = set()
    for _ in range(_LISTING_PASSES):
        tids = [t for t in _tids(fs, pid) if t not in done]
        if not tids:
            break
        for tid in tids:
            want = cpus.get(tid, default) if isinstance(cpus, dict) else cpus
            done.add(tid)
            if not want:
                continue
            try:
                if keep_subsets and os.sched_getaffinity(tid) <= want:
                    res.kept += 1
                    continue
                os.sched_setaffinity(tid, want)
                res.threads += 1
            except ProcessLookupError:
                res.vanished += 1
    if not done or not fs.exists(f"/proc/{pid}"):
        raise Exited(f"pid {pid} exited")
    return res


def get_affinity(fs: HostFS, pid: int) -> dict[int, frozenset[int]]:
    out: dict[int, frozenset[int]] = {}
    for tid in _tids(fs, pid):
        try:
            out[tid] = frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            pass
    if not out:
        raise Exited(f"pid {pid} exited")
    return out


def migrate_pages_syscall(pid: int, old_nodes: Iterable[int], new_nodes: Iterable[int]) -> int:
    """migrate_pages(2): returns the pages that could not be moved; raises OSError."""
    nr = _SYS_MIGRATE_PAGES.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"migrate_pages: syscall number unknown on {platform.machine()}")
    old, new = list(old_nodes), list(new_nodes)
    words = max([*old, *new, 0]) // 64 + 1
    old_mask = (ctypes.c_ulong * words)()
    new_mask = (ctypes.c_ulong * words)()
    for mask, nodes in ((old_mask, old), (new_mask, new)):
        for n in nodes:
            mask[n // 64] |= 1 << (n % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # The kernel reads maxnode - 1 bits (a historical off-by-one every caller compensates for).
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(pid), ctypes.c_ulong(words * 64 + 1), old_mask, new_mask)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"migrate_pages pid {pid}: {os.strerror(err)}")
    return int(rc)


@dataclass
class MigrateResult:
    noop: bool = False  # nothing to move: one memory node, or every page already on target
    moved: int = 0  # pages that left other nodes (numa_maps before minus after)
    not_moved: int = 0  # what the kernel said it could not move
    pages: dict[int, int] | None = None  # per node, after


def migrate(fs: HostFS, pid: int, target: int, memory_nodes: Iterable[int]) -> MigrateResult:
    others = [n for n in memory_nodes if n != target]
    if not others:
        return MigrateResult(noop=True, pages=numa_pages(fs, pid))
    before = numa_pages(fs, pid) or {}
    off_before = sum(v for n, v in before.items() if n != target)
    if before and off_before == 0:
        return MigrateResult(noop=True, pages=before)
    try:
        left = migrate_pages_syscall(pid, others, [target])
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise Exited(f"pid {pid} exited") from None
        raise
    after = numa_pages(fs, pid) or {}
    off_after = sum(v for n, v in after.items() if n != target)
    return MigrateResult(moved=max(0, off_before - off_after), not_moved=left, pages=after)


@dataclass
class Original:
    start: int
    threads: dict[int, frozenset[int]]
    # New threads did not exist before we pinned; they get the main thread's original mask back.
    default: frozenset[int] = field(default_factory=frozenset)

    def as_json(self) -> dict[str, object]:
        return {"start": self.start, "default": format_cpulist(self.default),
                "threads": {str(t): format_cpulist(c) for t, c in self.threads.items()}}

    @staticmethod
    def from_json(d: dict[str, object]) -> "Original":
        threads = d.get("threads") or {}
        assert isinstance(threads, dict)
        return Original(int(d["start"]),  # type: ignore[call-overload]
                        {int(t): parse_cpulist(str(c)) for t, c in threads.items()},
                        parse_cpulist(str(d.get("default", ""))))


class OriginalsStore:
    """Original affinities, kept on disk under state_dir so that a crashed agent's pins can still be undone."""

    FILE = "placement-originals.json"

    def __init__(self, state_dir: str | None):
        self.path = os.path.join(state_dir, self.FILE) if state_dir else None
        self.entries: dict[int, Original] = {}
        self.unreadable = False  # the file on disk could not be read: it is never written over or removed

    def load(self) -> None:
        """What a previous agent saved; raises statefile.StateFileError for a file that cannot be ours (kept)."""
        if not self.path:
            return
        try:
            data = statefile.load_json(self.path)
            try:
                self.entries = {int(pid): Original.from_json(v) for pid, v in (data or {}).items()}
            except (AttributeError, ValueError, KeyError, TypeError, AssertionError) as e:
                raise statefile.StateFileError(f"{self.path}: not a placement originals file ({e})") from None
        except statefile.StateFileError:
            self.unreadable = True
            raise

    def save(self) -> None:
        if not self.path or self.unreadable:
            return
        if not self.entries:
            self.remove()
            return
        statefile.save_json(self.path, {str(p): o.as_json() for p, o in self.entries.items()})

    def remove(self) -> None:
        if self.path and not self.unreadable:
            statefile.remove(self.path)


def restore(fs: HostFS, pid: int, orig: Original) -> AffinityResult:
    """Put the original masks back, only if pid still names the same process."""
    if proc_start(fs, pid) != orig.start:
        raise Exited(f"pid {pid} exited")
    return set_affinity(fs, pid, orig.threads, default=orig.default)


def restore_all(fs: HostFS, store: OriginalsStore) -> list[str]:
    """Originals back; one that could not be written stays saved for a later try (`qosagent detach`)."""
    lines = []
    kept = {}
    for pid, orig in sorted(store.entries.items()):
        try:
            res = restore(fs, pid, orig)
            lines.append(f"placement: pid {pid}: original CPU affinity restored on {res.threads} threads")
        except Exited:
            lines.append(f"placement: pid {pid}: exited, nothing to restore")
        except OSError as e:
            lines.append(f"placement: pid {pid}: restore failed: {e.strerror or e}; kept for a later restore")
            kept[pid] = orig
    store.entries = kept
    store.save()
    return lines
