"""Tracepoint and kprobe attachments of a loaded program, through perf events: perf_event_open(2) on the event,
then PERF_EVENT_IOC_SET_BPF. The attachment lasts while the event's fd is open, so a killed agent leaves none.

perf_event_open has no wrapper in libc or libbpf's low-level API (libbpf attaches only programs of its own
objects), so it is called by number (`qosagent/syscall.py`): one per architecture the agent ships for.
"""

from __future__ import annotations

import ctypes
import fcntl
import os

from qosagent import syscall
from qosagent.hostfs import HostFS

_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "arm64": 241}
PERF_TYPE_TRACEPOINT = 2
_PERF_FLAG_FD_CLOEXEC = 8
# _IOW('$', 8, __u32) and _IO('$', 0): the generic ioctl encoding, the same on x86-64 and arm64
_IOC_SET_BPF = 0x40042408
_IOC_ENABLE = 0x2400
_TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


class _Attr(ctypes.Structure):
    """The head of struct perf_event_attr (UAPI) through config2; `size` tells the kernel how much there is."""

    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32),
                ("bp_type", ctypes.c_uint32), ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64)]


def _open(attr: _Attr) -> int:
    attr.size = ctypes.sizeof(attr)
    attr.sample_period = 1
    attr.wakeup_events = 1
    return syscall.call("perf_event_open", _PERF_EVENT_OPEN, ctypes.byref(attr), ctypes.c_int(-1), ctypes.c_int(0),
                        ctypes.c_int(-1), ctypes.c_ulong(_PERF_FLAG_FD_CLOEXEC))


def _bind(fd: int, prog_fd: int) -> int:
    try:
        fcntl.ioctl(fd, _IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, _IOC_ENABLE, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


def tracepoint(fs: HostFS, category: str, event: str, prog_fd: int) -> int:
    """The program on tracepoint category:event; the returned fd holds the attachment."""
    for root in _TRACEFS:
        text = fs.try_read(f"{root}/events/{category}/{event}/id")
        if text:
            break
    else:
        raise OSError(2, f"tracepoint {category}:{event} not found under {' or '.join(_TRACEFS)} (tracefs mounted?)")
    attr = _Attr(type=PERF_TYPE_TRACEPOINT, config=int(text))
    return _bind(_open(attr), prog_fd)


def kprobe(fs: HostFS, function: str, prog_fd: int) -> int:
    """The program on entry to kernel function `function`, through the kprobe PMU (4.17): no kprobe_events entry
    is made, so nothing is left in tracefs when the fd closes."""
    kind = fs.try_read("/sys/bus/event_source/devices/kprobe/type")
    if not kind:
        raise OSError(2, "kprobes unavailable: no kprobe PMU (/sys/bus/event_source/devices/kprobe)")
    name = ctypes.create_string_buffer(function.encode())
    attr = _Attr(type=int(kind), config=0, config1=ctypes.addressof(name), config2=0)
    return _bind(_open(attr), prog_fd)
