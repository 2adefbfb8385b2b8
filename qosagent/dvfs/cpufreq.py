"""Writing cpufreq knobs: a policy's target frequency (clamped and snapped to what it offers) and the writes that
set it with its actuator, each saving the original first (the policies and their actuators: qosagent/cpufreq.py)."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable

from qosagent.cpufreq import Policy, ints
from qosagent.dvfs.rollback import Originals
from qosagent.hostfs import HostFS, HostFSError


def resolve_khz(p: Policy, kind: str, value: float) -> int | None:
    """A point's frequency for this policy: relative to cpuinfo_max_freq, clamped, snapped to what it offers."""
    if kind == "pct":
        if p.max_khz is None:
            return None
        khz = int(p.max_khz * value / 100)
    else:
        khz = int(value)
    if p.min_khz is not None:
        khz = max(khz, p.min_khz)
    if p.max_khz is not None:
        khz = min(khz, p.max_khz)
    if p.available:
        below = [f for f in p.available if f <= khz]
        khz = below[-1] if below else p.available[0]
    return khz


@dataclass(frozen=True)
class WriteResult:
    path: str
    want: str
    status: str  # written, same, foreign, failed, mismatch
    read_back: str | None = None
    error: str = ""  # errno name for failed


class Writer:
    """Every write to a knob: same-value skip, original saved first, read back and compared, owner checked."""

    def __init__(self, fs: HostFS, originals: Originals):
        self.fs = fs
        self.originals = originals

    def set(self, path: str, want: str, same: Callable[[str, str], bool]) -> WriteResult:
        key = f"file:{path}"
        try:
            current = self.fs.read_text(path)
        except HostFSError as e:
            return WriteResult(path, want, "failed", None, errno.errorcode.get(e.errno or 0, "EIO"))
        if not self.originals.is_ours(key, current):
            return WriteResult(path, want, "foreign", current)
        if same(current, want):
            return WriteResult(path, want, "same", current)
        self.originals.before_write(key, current, want)
        try:
            self.fs.write_text(path, want)
        except HostFSError as e:
            return WriteResult(path, want, "failed", None, errno.errorcode.get(e.errno or 0, "EIO"))
        try:
            back = self.fs.read_text(path)
        except HostFSError as e:
            return WriteResult(path, want, "failed", None, errno.errorcode.get(e.errno or 0, "EIO"))
        # What the driver kept (rounded to its steps) is what is ours from now on.
        self.originals.after_write(key, back)
        return WriteResult(path, want, "written" if same(back, want) else "mismatch", back)


def same_khz(tolerance_khz: int) -> Callable[[str, str], bool]:
    def same(read: str, want: str) -> bool:
        try:
            return abs(int(read) - int(want)) <= tolerance_khz
        except ValueError:
            return False

    return same


def same_text(read: str, want: str) -> bool:
    return read.strip() == want.strip()


def freq_writes(fs: HostFS, p: Policy, khz: int, originals: Originals) -> list[tuple[str, str]]:
    """(path, value) in the order to write them for target khz with p's actuator (not max_perf_pct)."""
    if p.actuator == "scaling_setspeed":
        return [(f"{p.dir}/scaling_setspeed", str(khz))]
    assert p.actuator == "scaling_max_freq"
    min_path, max_path = f"{p.dir}/scaling_min_freq", f"{p.dir}/scaling_max_freq"
    cur_max = ints(fs.try_read(max_path))
    cur_min = ints(fs.try_read(min_path))
    orig_min = ints(originals.original(f"file:{min_path}")) or cur_min
    writes = [(max_path, str(khz))]
    if cur_min and orig_min:
        # min follows max down when max goes below it and back to its original when max allows.
        writes.append((min_path, str(min(orig_min[0], khz))))
    # Old kernels refuse max < min (EINVAL) and min > max: lower min first when going down, max first going up.
    if cur_max and khz < cur_max[0]:
        writes.reverse()
    return writes
