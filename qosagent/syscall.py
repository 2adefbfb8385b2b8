"""System calls by number, for those the C library wraps under no name every libc exports (bpf, perf_event_open,
sched_setattr, migrate_pages): ctypes' syscall(2) with the number of this machine's architecture. One copy of the
calling convention (restype long, errno on a negative return) instead of one per caller."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Any, Mapping

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def call(what: str, numbers: Mapping[str, int], *args: Any) -> int:
    """syscall(numbers[this machine], *args) (args as ctypes values): its non-negative result, or OSError with the
    errno and `what` (the call, and what it was for) in the message; ENOSYS where no number is known here."""
    nr = numbers.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"{what}: syscall number unknown on {platform.machine()}")
    rc = _libc.syscall(ctypes.c_long(nr), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return int(rc)
