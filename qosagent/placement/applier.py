"""The writes of placement: CPU affinity of every thread, migrate_pages(2), and the originals to put back; and
the Applier, which carries out the capability's decided commands with them.

Threads are listed through /proc/PID/task; a thread born while we set the others inherits its creator's mask,
which may still be the old one, so the listing is repeated until it brings no new thread. A process or thread that
exits halfway is an ordinary outcome (ESRCH), never an error.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

from qosagent import statefile, syscall
from qosagent.cpulist import format_cpulist, parse_cpulist
from qosagent.hostfs import HostFS
from qosagent.placement.discovery import numa_pages, proc_start, thread_cpus
from qosagent.placement.model import Drop, Place, Record
from qosagent.placement.topology import Topology

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
    old, new = list(old_nodes), list(new_nodes)
    words = max([*old, *new, 0]) // 64 + 1
    old_mask = (ctypes.c_ulong * words)()
    new_mask = (ctypes.c_ulong * words)()
    for mask, nodes in ((old_mask, old), (new_mask, new)):
        for n in nodes:
            mask[n // 64] |= 1 << (n % 64)
    # The kernel reads maxnode - 1 bits (a historical off-by-one every caller compensates for).
    return syscall.call(f"migrate_pages pid {pid}", _SYS_MIGRATE_PAGES, ctypes.c_int(pid),
                        ctypes.c_ulong(words * 64 + 1), old_mask, new_mask)


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
        self.file = statefile.Kept(state_dir, self.FILE, "placement originals")
        self.entries: dict[int, Original] = {}

    @property
    def path(self) -> str | None:
        return self.file.path

    def load(self) -> None:
        """What a previous agent saved; raises statefile.StateFileError for a file that cannot be ours (kept)."""
        self.entries = self.file.read(lambda data: {int(pid): Original.from_json(v) for pid, v in data.items()}, {})

    def save(self) -> None:
        self.file.write({str(p): o.as_json() for p, o in self.entries.items()} if self.entries else None)


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


@dataclass(frozen=True)
class Settings:
    """What the config in force says of the writes: enforce (else dry-run: recorded, not written), migrate_memory,
    and the topology (its memory nodes)."""

    enforce: bool
    migrate_memory: bool
    topology: Topology | None


class Applier:
    """Carries out placement's commands: originals saved (to state_dir) before a process's first write, affinity
    set on every thread, pages migrated, the result read back; each process's Record and the counters say what
    was done, and a failed write is counted and kept on the record, never raised."""

    def __init__(self, fs: HostFS, store: OriginalsStore, counters: dict[str, collections.Counter[str]],
                 clock: Callable[[], float]):
        self.fs, self.store, self.counters, self.clock = fs, store, counters, clock

    def run(self, commands: Iterable[tuple[Place | Drop, float]], records: dict[int, Record], s: Settings) -> None:
        """commands: each with its decision's wall time; records: the capability's, updated in place."""
        for c, at in commands:
            pid = c.pid if isinstance(c, Drop) else c.proc.pid
            action = ("release" if c.release else "forget") if isinstance(c, Drop) else c.action
            self.counters["actions"][action] += 1
            if action == "correct":
                self.counters["drift"]["corrected" if s.enforce else "seen"] += 1
            try:
                if isinstance(c, Drop):
                    self._drop(c, records)
                else:
                    self._place(c, at, records, s)
            except Exited:
                # Exited between discovery and the write: nothing to undo, nothing to keep.
                self.counters["errors"]["exited"] += 1
                records.pop(pid, None)
                self.store.entries.pop(pid, None)
            except OSError as e:
                self.counters["errors"]["permission" if isinstance(e, PermissionError) else "write"] += 1
                rec = records.get(pid)
                if rec is not None:
                    rec.applied = False
                    rec.last_action = "error"
                    rec.reason = f"{action} failed: {e.strerror or e}"
                log.warning("pid %d: %s failed: %s", pid, action, e)
        self.save_store()

    def save_store(self) -> None:
        try:
            self.store.save()
        except OSError as e:
            self.counters["errors"]["state_dir"] += 1
            log.warning("cannot save original affinities: %s", e)

    def _restore(self, pid: int, orig: Original) -> AffinityResult:
        """The original back, forgotten only once written: a failed write keeps it (memory and state file) for a
        later tick, stop() or `qosagent detach`. A process gone is nothing to restore (Exited)."""
        try:
            res = restore(self.fs, pid, orig)
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.ENOENT):
                raise Exited(f"pid {pid} exited") from None
            raise
        self.store.entries.pop(pid, None)
        return res

    def _drop(self, c: Drop, records: dict[int, Record]) -> None:
        orig = self.store.entries.get(c.pid)
        if c.release and orig is not None:
            self._restore(c.pid, orig)  # on failure the record stays too, so a later reconcile releases again
        self.store.entries.pop(c.pid, None)
        records.pop(c.pid, None)

    def _place(self, c: Place, at: float, records: dict[int, Record], s: Settings) -> None:
        p, t, pid = c.proc, c.target, c.proc.pid
        rec = records.get(pid)
        if rec is None or rec.start != p.start:
            rec = records[pid] = Record(pid, p.start, p.name, p.selector)
        rec.gpus, rec.last_action, rec.reason, rec.at = t.gpus, c.action, c.reason, at
        if c.action == "leave":
            rec.node, rec.cpus, rec.applied, rec.verified = None, None, False, None
            return
        if c.action == "restore":
            rec.threads = self._restore(pid, self.store.entries[pid]).threads
            rec.node, rec.cpus, rec.applied, rec.verified = None, None, True, None
            return
        rec.node, rec.cpus = t.node, t.cpus
        if not s.enforce:
            rec.applied = False
            return
        assert t.cpus is not None and s.topology is not None
        if pid not in self.store.entries:
            before = get_affinity(self.fs, pid)
            self.store.entries[pid] = Original(p.start, before, before.get(pid, next(iter(before.values()))))
            self.save_store()  # before the first write: a crash right after it must still be undoable
        res = set_affinity(self.fs, pid, t.cpus, keep_subsets=True)
        rec.threads, rec.applied = res.threads + res.kept, True
        if c.action == "pin" and s.migrate_memory and t.node is not None and s.topology.numa:
            self._migrate(rec, pid, t.node, s.topology)
        back = thread_cpus(self.fs, pid)
        if not back:
            raise Exited(f"pid {pid} exited")
        rec.verified = all(cpus <= t.cpus for cpus in back.values())
        if not rec.verified:
            self.counters["drift"]["unverified"] += 1

    def _migrate(self, rec: Record, pid: int, node: int, topology: Topology) -> None:
        try:
            m = migrate(self.fs, pid, node, topology.memory_nodes())
        except OSError as e:
            self.counters["migrations"]["failed"] += 1
            log.warning("pid %d: migrate_pages to node %s failed: %s", pid, node, e)
        else:
            self.counters["migrations"]["noop" if m.noop else "moved"] += 1
            self.counters["pages_migrated"]["moved"] += m.moved
            self.counters["pages_migrated"]["not_moved"] += m.not_moved
            rec.pages, rec.locality_at = m.pages, self.clock()
