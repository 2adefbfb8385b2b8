"""The writes of resources: cgroup controller files, processes moved into the agent's own cgroups, and threads'
scheduling attributes; each original saved (fsynced, under state_dir) before the first write, and put back on
stop, by the next agent after a crash, or by `qosagent detach`.

A group's files are written as one: when the kernel refuses one (EBUSY, EINVAL, EPERM, ENOENT), the ones already
written for it go back, so nothing is left half-applied. A process or thread gone mid-apply is an ordinary outcome.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any, Iterable

from qosagent import statefile
from qosagent.cgroups import cgroup_dir
from qosagent.hostfs import HostFS
from qosagent.listeners import proc_start
from qosagent.resources import discovery, reading, sched
from qosagent.resources.model import (BackOff, Counters, Files, Group, GroupReport, Hint, Memory, Move, Release,
                                     Sched)

log = logging.getLogger("qosagent.resources")


def _err(e: OSError) -> str:
    """An error's kind for the counters: its errno's name (EBUSY, EINVAL, EPERM, ENOENT ...)."""
    return errno.errorcode.get(e.errno or 0, "error")


@dataclass
class Thread:
    pid: int
    start: int
    attr: sched.Attr


@dataclass
class Moved:
    start: int
    back: dict[str, str]  # controller -> the directory it came from
    into: dict[str, str] = field(default_factory=dict)  # controller -> ours


class Store:
    """The originals, on disk under state_dir so that a crashed agent's writes can still be undone."""

    FILE = "resources-originals.json"

    def __init__(self, state_dir: str | None):
        self.file = statefile.Kept(state_dir, self.FILE, "resources originals")
        self.files: dict[str, str] = {}  # host path -> original value
        self.moved: dict[int, Moved] = {}
        self.created: list[str] = []  # our cgroup directories, removed once empty
        self.threads: dict[int, Thread] = {}  # tid ->
        self.default_slice = 0  # what a thread without a custom slice reads back (sched.restoring)

    def empty(self) -> bool:
        return not (self.files or self.moved or self.created or self.threads)

    def load(self) -> None:
        """What a previous agent saved; raises statefile.StateFileError for a file that cannot be ours (kept)."""
        self.file.read(self._parse, None)

    def _parse(self, data: dict[str, Any]) -> None:
        self.files = {str(k): str(v) for k, v in data.get("files", {}).items()}
        self.moved = {int(p): Moved(int(m["start"]), dict(m["back"]), dict(m.get("into", {})))
                      for p, m in data.get("moved", {}).items()}
        self.created = [str(d) for d in data.get("created", [])]
        self.threads = {int(t): Thread(int(v["pid"]), int(v["start"]), sched.Attr.from_json(v["attr"]))
                        for t, v in data.get("threads", {}).items()}
        self.default_slice = int(data.get("default_slice", 0))

    def save(self) -> None:
        self.file.write(None if self.empty() else {
            "files": self.files,
            "moved": {str(p): {"start": m.start, "back": m.back, "into": m.into} for p, m in self.moved.items()},
            "created": self.created,
            "threads": {str(t): {"pid": v.pid, "start": v.start, "attr": v.attr.as_json()}
                        for t, v in self.threads.items()},
            "default_slice": self.default_slice,
        })


def _of(path: str, directory: str, controller: str) -> bool:
    """Whether a file is one of a controller's in a cgroup: on cgroup v2 one directory holds every controller's
    files, so a group (one controller's) owns only those named after it (cpu.max, memory.min)."""
    return posixpath.dirname(path) == directory and posixpath.basename(path).startswith(controller + ".")


def tids(fs: HostFS, pid: int) -> list[int]:
    return sorted(int(t) for t in fs.listdir(f"/proc/{pid}/task") if t.isdigit())


def restore_all(fs: HostFS, store: Store) -> list[str]:
    """Everything back, in reverse of how it was done: threads, files, processes moved, our cgroups removed. What
    could not be put back stays saved for a later try (`qosagent detach`)."""
    lines: list[str] = []
    n = 0
    kept_threads = {}
    for tid, t in sorted(store.threads.items()):
        if proc_start(fs, t.pid) != t.start or not fs.exists(f"/proc/{t.pid}/task/{tid}"):
            continue
        try:
            sched.set(tid, sched.restoring(t.attr, store.default_slice))
            n += 1
        except OSError as e:
            if e.errno != errno.ESRCH:
                kept_threads[tid] = t
                lines.append(f"resources: tid {tid}: scheduling not restored: {e.strerror or e}; kept")
    if n:
        lines.append(f"resources: scheduling restored on {n} threads")
    store.threads = kept_threads
    kept_files = {}
    for path, value in sorted(store.files.items(), reverse=True):
        try:
            fs.write_text(path, value)
            lines.append(f"resources: {path} restored to {value}")
        except OSError as e:
            if e.errno == errno.ENOENT:
                continue  # the cgroup is gone, and what was set with it
            kept_files[path] = value
            lines.append(f"resources: {path}: restore failed: {e.strerror or e}; kept for a later restore")
    store.files = kept_files
    kept_moved = {}
    for pid, m in sorted(store.moved.items()):
        if proc_start(fs, pid) != m.start:
            continue
        try:
            for directory in sorted(set(m.back.values())):
                fs.write_text(f"{directory}/cgroup.procs", str(pid))
            lines.append(f"resources: pid {pid} moved back to {', '.join(sorted(set(m.back.values())))}")
        except OSError as e:
            kept_moved[pid] = m
            lines.append(f"resources: pid {pid}: move back failed: {e.strerror or e}; kept")
    store.moved = kept_moved
    kept_dirs = []
    for d in reversed(store.created):
        try:
            os.rmdir(fs.path(d))
            lines.append(f"resources: removed {d}")
        except FileNotFoundError:
            continue
        except OSError as e:
            kept_dirs.insert(0, d)
            lines.append(f"resources: {d}: not removed: {e.strerror or e}; kept")
    store.created = kept_dirs
    store.save()
    return lines


def wanted(orig: sched.Attr, h: Hint) -> sched.Attr:
    """A thread's attributes under the hint: its policy, and the slice or nice it gives; the rest as it was. A
    slice hint reads back as the slice; otherwise the runtime a thread reads is the kernel's, not ours to compare."""
    nice = h.nice if h.nice is not None else orig.nice
    return sched.Attr(sched.POLICIES[h.policy], nice, h.slice_ns or orig.runtime)


class Refused(Exception):
    """The kernel refused a write of a group; what was written of it went back."""

    def __init__(self, path: str, err: OSError):
        self.path, self.err = path, err
        super().__init__(f"{path}: {err.strerror or err}")


class Applier:
    """Carries out resources' commands; counts what it did and what failed, never raises for a refused write."""

    def __init__(self, fs: HostFS, store: Store, counters: Counters):
        self.fs, self.store, self.counters = fs, store, counters
        self.written: dict[str, str] = {}  # host path -> the value we last wrote there (for the rewrite check)

    def save(self) -> None:
        try:
            self.store.save()
        except OSError as e:
            self.counters["errors"]["state_dir"] += 1
            log.warning("cannot save the originals: %s", e)

    # ---- controller files --------------------------------------------------------------------------------
    def files(self, cmd: Files) -> dict[str, str]:
        """Write the group's files; files we set there before and no longer want go back to their originals.
        Returns what is set; raises Refused (counted) after putting back what this call wrote."""
        g = cmd.group
        want = dict(cmd.values)
        paths = {f"{g.directory}/{f}": v for f, v in cmd.values}
        done: list[str] = []
        try:
            for path, value in paths.items():
                current = self.fs.try_read(path)
                if current is None:
                    raise OSError(errno.ENOENT, f"{path} cannot be read", path)
                if current.split() == value.split():
                    self.written[path] = value
                    continue
                if path not in self.store.files:
                    if posixpath.basename(path) in reading.LIMITS:
                        _say_above(self.fs, g, posixpath.basename(path), value)
                    self.store.files[path] = current.strip()
                    self.save()  # before the first write: a crash right after it must still be undoable
                self.fs.write_text(path, value)
                done.append(path)
                self.written[path] = value
        except OSError as e:
            self.counters["errors"][_err(e)] += 1
            for path in reversed(done):
                self._put_back(path)
            raise Refused(e.filename or g.directory, e) from None
        for path in sorted(p for p in self.store.files if _of(p, g.directory, g.controller) and p not in paths):
            self._put_back(path)
        self.counters["writes"][g.controller] += len(done)
        return want

    def _put_back(self, path: str) -> None:
        value = self.store.files.get(path)
        self.written.pop(path, None)
        if value is None:
            return
        try:
            self.fs.write_text(path, value)
        except OSError as e:
            if e.errno != errno.ENOENT:
                self.counters["errors"][_err(e)] += 1
                log.warning("%s: putting back %s failed: %s", path, value, e)
                return
        del self.store.files[path]
        self.save()

    def release(self, directory: str, controller: str) -> None:
        """Every file we set in a cgroup for a controller back to its original (its processes left it, or its tier
        lost `resources:`)."""
        for path in sorted(p for p in self.store.files if _of(p, directory, controller)):
            self._put_back(path)

    def rewritten(self, directory: str, controller: str) -> list[str]:
        """A controller's files of a cgroup that no longer read what we wrote: someone else (the kubelet, systemd)
        set them."""
        out = []
        for path, value in self.written.items():
            if _of(path, directory, controller):
                now = self.fs.try_read(path)
                if now is not None and now.split() != value.split():
                    out.append(path)
        return out

    def let_go(self, paths: Iterable[str]) -> None:
        """Another owner's values stay: neither rewritten by us nor restored over."""
        for path in paths:
            self.written.pop(path, None)
            self.store.files.pop(path, None)
        self.save()

    # ---- moves ---------------------------------------------------------------------------------------------
    def move(self, g: Group, pids: Iterable[int], into: str) -> int:
        """Move serving processes of a group into `into` (created where missing); returns how many moved."""
        if not self.fs.is_dir(into):
            os.mkdir(self.fs.path(into))
            if into not in self.store.created:
                self.store.created.append(into)
                self.save()
        moved = 0
        for pid in pids:
            start = proc_start(self.fs, pid)
            if start is None:
                continue
            m = self.store.moved.get(pid)
            if m is None or m.start != start:
                m = self.store.moved[pid] = Moved(start, {})
            m.back.setdefault(g.controller, g.directory)
            m.into[g.controller] = into
            self.save()
            try:
                self.fs.write_text(f"{into}/cgroup.procs", str(pid))
                moved += 1
            except OSError as e:
                if e.errno == errno.ESRCH:
                    continue
                self.counters["errors"][_err(e)] += 1
                raise Refused(f"{into}/cgroup.procs", e) from None
        self.counters["moves"][g.controller] += moved
        return moved

    # ---- threads -------------------------------------------------------------------------------------------
    def hint(self, pids: Iterable[int], h: Hint) -> int:
        """Every thread of pids not yet holding the hint given it (originals saved first); returns how many now. A
        thread born since its process was first set inherited the hint: its original is the main thread's."""
        changed = 0
        for pid in pids:
            start = proc_start(self.fs, pid)
            if start is None:
                continue
            main = self.store.threads.get(pid)
            main_orig = main.attr if main is not None and main.start == start and main.pid == pid else None
            for tid in tids(self.fs, pid):
                try:
                    t = self.store.threads.get(tid)
                    if t is None or t.start != start or t.pid != pid:
                        orig = main_orig if main_orig is not None and tid != pid else sched.get(tid)
                        t = self.store.threads[tid] = Thread(pid, start, orig)
                        self.save()
                    want = wanted(t.attr, h)
                    if sched.get(tid) == want:
                        continue
                    sched.set(tid, want)
                    changed += 1
                except OSError as e:
                    if e.errno == errno.ESRCH:
                        self.store.threads.pop(tid, None)
                        continue
                    self.counters["errors"][_err(e)] += 1
                    log.warning("tid %d of pid %d: %s", tid, pid, e)
        self.counters["threads"]["set"] += changed
        return changed

    def unhint(self, pids: Iterable[int]) -> None:
        """The threads of pids back to their originals (no longer a serving process of a tier with a hint)."""
        gone = set(pids)
        for tid, t in sorted(self.store.threads.items()):
            if t.pid not in gone:
                continue
            if proc_start(self.fs, t.pid) == t.start:
                try:
                    sched.set(tid, sched.restoring(t.attr, self.store.default_slice))
                except OSError as e:
                    if e.errno != errno.ESRCH:
                        self.counters["errors"][_err(e)] += 1
                        continue
            del self.store.threads[tid]
        self.save()


# ---- a decision's command, carried out -------------------------------------------------------------------------
def _say_above(fs: HostFS, g: Group, file: str, value: str) -> None:
    """A server already using more than a limit it gets is throttled, reclaimed or refused from this first write on
    (an upgrade that brings memory.high's default does so unasked): said once, as `qosagent check` says it."""
    found = reading.memory_check(fs, g, {file: value})
    if found is not None and found.above:
        hint = (f" (tiers.{g.tier}.resources.memory_high sets another, max for none)" if file == "memory.high"
                else "")
        log.warning("%s%s", found.line("gets"), hint)


def carry_out(a: Applier, mem: Memory, enforce: bool, c: Any) -> None:
    """One decision's command: what resources remembers of it, and in enforce its writes."""
    if isinstance(c, Files):
        _apply_files(a, mem, enforce, c)
    elif isinstance(c, Release):
        mem.decided.pop(c.group.key, None)
        mem.reports.pop(c.group.key, None)
        if enforce:
            a.release(c.group.directory, c.group.controller)
    elif isinstance(c, Move):
        _apply_move(a, mem, enforce, c)
    elif isinstance(c, BackOff):
        mem.backed_off.add(c.group.key)
        a.counters["rewritten"][c.group.controller] += 1
        log.warning("%s: %s rewritten by another owner (the kubelet, systemd): left to it", c.group.key,
                    ", ".join(os.path.basename(p) for p in c.paths))
        a.let_go(c.paths)
    elif isinstance(c, Sched):
        _apply_sched(a, mem, enforce, c)


def _apply_files(a: Applier, mem: Memory, enforce: bool, c: Files) -> None:
    g = c.group
    mem.decided[g.key] = c.values
    if not enforce:
        mem.reports[g.key] = GroupReport(g, dict(c.values), applied=False)
        return
    try:
        a.files(c)
        mem.reports[g.key] = GroupReport(g, dict(c.values), applied=True)
    except Refused as e:
        mem.reports[g.key] = GroupReport(g, dict(c.values), applied=False, error=str(e))
        # Tried again at the next reconcile, not every tick: a refusal is the kernel's answer for a while.
        mem.decided.pop(g.key, None)
        log.warning("%s: not set, what was written of it is back: %s", g.key, e)


def _apply_move(a: Applier, mem: Memory, enforce: bool, c: Move) -> None:
    g = c.group
    if not enforce:
        return
    try:
        for tier, pids in c.by_tier:
            into = cgroup_dir(a.fs, g.version, g.controller, discovery.own_cgroup(tier))
            if into is None:
                raise OSError(2, f"the {g.controller} hierarchy is not mounted")
            a.move(g, pids, into)
    except (Refused, OSError) as e:
        mem.states.pop(g.key, None)  # tried again at the next reconcile
        log.warning("%s: moving its serving processes failed: %s", g.key, e)


def _apply_sched(a: Applier, mem: Memory, enforce: bool, c: Sched) -> None:
    if c.hint is None:
        for pid in c.pids:
            mem.hinted.pop(pid, None)
        if enforce:
            a.unhint(c.pids)
        return
    for pid in c.pids:
        mem.hinted[pid] = (c.tier, c.hint)
    if enforce:
        a.hint(c.pids, c.hint)
