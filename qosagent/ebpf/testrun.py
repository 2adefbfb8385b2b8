"""BPF_PROG_TEST_RUN (bpf() command 10) for cls programs: one packet in, the verdict and the time per run out.

bcc does not wrap the command. Used by the odd-packet tests and the classifier benchmark."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from qosagent.ebpf.syscall import BPF_PROG_TEST_RUN, bpf


class _TestRunAttr(ctypes.Structure):
    _fields_ = [("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32), ("data_size_in", ctypes.c_uint32),
                ("data_size_out", ctypes.c_uint32), ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),
                ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32), ("ctx_size_in", ctypes.c_uint32),
                ("ctx_size_out", ctypes.c_uint32), ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32)]


@dataclass(frozen=True)
class RunResult:
    retval: int  # the program's return value, signed (TC_ACT_UNSPEC is -1)
    ns_per_run: int  # the kernel's average over `repeat` runs


def test_run(prog_fd: int, packet: bytes, repeat: int = 1) -> RunResult:
    """Run the program on one Ethernet frame (at least 14 bytes, as the kernel requires for skb programs)."""
    data = ctypes.create_string_buffer(packet, len(packet))
    out = ctypes.create_string_buffer(len(packet) + 256)
    attr = _TestRunAttr(prog_fd=prog_fd, data_size_in=len(packet), data_in=ctypes.addressof(data),
                        data_size_out=len(out), data_out=ctypes.addressof(out), repeat=repeat)
    bpf(BPF_PROG_TEST_RUN, attr)
    return RunResult(ctypes.c_int32(attr.retval).value, int(attr.duration))
