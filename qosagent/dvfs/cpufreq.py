"""cpufreq policies and their actuators, chosen by probing what the driver offers.

- scaling_setspeed: under the userspace governor (acpi-cpufreq, intel_cpufreq and amd-pstate in passive mode).
- scaling_max_freq: any driver; the default elsewhere (intel_pstate active has no setspeed at all).
- max_perf_pct: intel_pstate's global cap, one file for every policy it drives.
- energy_performance_preference: alongside, where offered and the governor is not performance (EBUSY there).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable

from qosagent.cpulist import parse_cpulist
from qosagent.dvfs.rollback import Originals
from qosagent.hostfs import HostFS, HostFSError

CPU = "/sys/devices/system/cpu"
PSTATE = f"{CPU}/intel_pstate"
ACTUATORS = ("scaling_setspeed", "scaling_max_freq", "max_perf_pct")


@dataclass(frozen=True)
class Policy:
    name: str  # policyN, N the first of related_cpus, as the kernel names it
    dir: str  # host path of the policy's cpufreq directory
    cpus: tuple[int, ...]
    driver: str
    governor: str
    min_khz: int | None  # cpuinfo_min_freq, else the lowest known bound
    max_khz: int | None  # cpuinfo_max_freq, else the highest known bound
    available: tuple[int, ...] = ()  # scaling_available_frequencies, ascending
    epp_prefs: tuple[str, ...] = ()  # offered energy_performance_preference values; () when not usable
    actuator: str | None = None  # one of ACTUATORS; None: monitor only
    why: str = ""  # why this actuator (or none)


def ints(text: str | None) -> tuple[int, ...]:
    out = []
    for tok in (text or "").split():
        if tok.isdigit():
            out.append(int(tok))
    return tuple(sorted(out))


def _cpulist(text: str | None) -> tuple[int, ...]:
    """A policy's CPUs; an unreadable list means no CPUs (the policy is then monitored only)."""
    try:
        return tuple(sorted(parse_cpulist(text or "")))
    except ValueError:
        return ()


def _policy_dirs(fs: HostFS) -> list[str]:
    dirs = fs.glob(f"{CPU}/cpufreq", "policy*")
    if dirs:
        return dirs
    # Older kernels (and snapshots of them) have only cpuN/cpufreq, often one link per CPU to a shared policy.
    seen: dict[str, str] = {}
    for cpu in fs.glob(CPU, "cpu[0-9]*"):
        d = f"{cpu}/cpufreq"
        if fs.is_dir(d):
            seen.setdefault(fs.realpath(d), d)
    return list(seen.values())


def choose_actuator(fs: HostFS, d: str, driver: str, governor: str, wanted: str) -> tuple[str | None, str]:
    setspeed = fs.try_read(f"{d}/scaling_setspeed")
    offers = {
        "scaling_setspeed": governor == "userspace" and setspeed is not None and setspeed != "<unsupported>",
        "scaling_max_freq": fs.exists(f"{d}/scaling_max_freq"),
        "max_perf_pct": driver == "intel_pstate" and fs.exists(f"{PSTATE}/max_perf_pct"),
    }
    if wanted != "auto":
        if offers[wanted]:
            return wanted, "configured"
        return None, f"configured actuator {wanted} not offered by {driver}/{governor}"
    for a in ACTUATORS:
        if offers[a]:
            return a, f"{driver}/{governor}"
    return None, f"{driver}/{governor} offers no frequency knob"


def discover(fs: HostFS, wanted: str = "auto") -> list[Policy]:
    out = []
    for d in _policy_dirs(fs):
        cpus = _cpulist(fs.try_read(f"{d}/related_cpus") or fs.try_read(f"{d}/affected_cpus"))
        leaf = d.rsplit("/", 2)[-2] if d.endswith("/cpufreq") else ""
        if leaf[3:].isdigit() and int(leaf[3:]) not in cpus:
            # cpuN/cpufreq is a policy of its own (the link would have merged it): a related_cpus without N is a
            # broken snapshot, and the directory is the better witness.
            cpus = (int(leaf[3:]),)
        driver = fs.try_read(f"{d}/scaling_driver") or "unknown"
        governor = fs.try_read(f"{d}/scaling_governor") or "unknown"
        available = ints(fs.try_read(f"{d}/scaling_available_frequencies"))
        # cpuinfo_* are missing on some hosts (the real snapshot has none): the scaling bounds as the agent found
        # them are then the range, which never lets the agent go beyond what the host allowed.
        lo = ints(fs.try_read(f"{d}/cpuinfo_min_freq")) or available[:1] or ints(fs.try_read(f"{d}/scaling_min_freq"))
        hi = ints(fs.try_read(f"{d}/cpuinfo_max_freq")) or available[-1:] or ints(fs.try_read(f"{d}/scaling_max_freq"))
        epp: tuple[str, ...] = ()
        if fs.exists(f"{d}/energy_performance_preference") and governor != "performance":
            epp = tuple((fs.try_read(f"{d}/energy_performance_available_preferences") or "").split())
        actuator, why = choose_actuator(fs, d, driver, governor, wanted)
        name = d.rsplit("/", 1)[1] if not leaf else f"policy{cpus[0]}"
        out.append(Policy(name, d, cpus, driver, governor, lo[0] if lo else None, hi[0] if hi else None,
                          available, epp, actuator, why))
    return sorted(out, key=lambda p: p.cpus or (1 << 30,))


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
