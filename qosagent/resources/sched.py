"""sched_setattr(2) and sched_getattr(2) for one thread: the policy (normal, batch, idle), nice, and the custom
slice EEVDF takes from sched_runtime for a fair-class thread (Linux 6.12+). glibc has no wrapper for either; the
syscall numbers are per architecture. Whether the kernel honours a custom slice is found by probing it on a thread
of our own that exits right after."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from qosagent import syscall

# (sched_setattr, sched_getattr)
_SETATTR = {"x86_64": 314, "aarch64": 274}
_GETATTR = {"x86_64": 315, "aarch64": 275}
POLICIES = {"normal": 0, "batch": 3, "idle": 5}  # SCHED_OTHER, SCHED_BATCH, SCHED_IDLE
NAMES = {v: k for k, v in POLICIES.items()}


class _Attr(ctypes.Structure):
    # struct sched_attr, SCHED_ATTR_SIZE_VER0 (48 bytes): the fields this module reads and writes.
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64)]


@dataclass(frozen=True)
class Attr:
    policy: int
    nice: int
    runtime: int  # ns; 0: the kernel's default slice

    def as_json(self) -> list[int]:
        return [self.policy, self.nice, self.runtime]

    @staticmethod
    def from_json(v: list[int]) -> "Attr":
        return Attr(int(v[0]), int(v[1]), int(v[2]))


def get(tid: int) -> Attr:
    a = _Attr()
    syscall.call(f"sched_getattr tid {tid}", _GETATTR, ctypes.c_int(tid), ctypes.byref(a),
                 ctypes.c_uint(ctypes.sizeof(a)), ctypes.c_uint(0))
    return Attr(a.sched_policy, a.sched_nice, a.sched_runtime)


def set(tid: int, attr: Attr) -> None:  # noqa: A001 - the syscall's own verb
    """Only the fair policies (normal, batch, idle) are set here: their runtime is the custom slice."""
    a = _Attr(size=ctypes.sizeof(_Attr), sched_policy=attr.policy, sched_nice=attr.nice,
              sched_runtime=attr.runtime)
    syscall.call(f"sched_setattr tid {tid}", _SETATTR, ctypes.c_int(tid), ctypes.byref(a), ctypes.c_uint(0))


@dataclass(frozen=True)
class SliceProbe:
    supported: bool  # the kernel keeps a custom slice
    default_ns: int  # what a thread without one reads back (6.12+ reports the slice in force, custom or not)


def probe_slice(slice_ns: int) -> SliceProbe:
    """Whether this kernel keeps a custom slice: set on a thread of our own, read back; the thread then exits."""
    result: list[SliceProbe] = []

    def trial() -> None:
        try:
            tid = threading.get_native_id()
            base = get(tid)
            set(tid, Attr(base.policy, base.nice, slice_ns))
            result.append(SliceProbe(get(tid).runtime == slice_ns, base.runtime))
        except OSError:
            result.append(SliceProbe(False, 0))

    t = threading.Thread(target=trial, name="qosagent-slice-probe")
    t.start()
    t.join()
    return result[0] if result else SliceProbe(False, 0)


def restoring(orig: Attr, default_ns: int) -> Attr:
    """What puts a thread back: its original, with no custom slice where it read the default one (writing the
    default's value would pin it as a custom slice that no longer follows the kernel's)."""
    return Attr(orig.policy, orig.nice, 0 if orig.runtime == default_ns else orig.runtime)
