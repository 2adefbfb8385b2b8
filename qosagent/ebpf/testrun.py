"""BPF_PROG_TEST_RUN for cls programs: one packet in, the verdict and the time per run out (through libbpf's
bpf_prog_test_run_opts). Used by the odd-packet tests and the classifier benchmark."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from qosagent.ebpf.libbpf import TestRunOpts, prog_test_run


@dataclass(frozen=True)
class RunResult:
    retval: int  # the program's return value, signed (TC_ACT_UNSPEC is -1)
    ns_per_run: int  # the kernel's average over `repeat` runs


def test_run(prog_fd: int, packet: bytes, repeat: int = 1) -> RunResult:
    """Run the program on one Ethernet frame (at least 14 bytes, as the kernel requires for skb programs)."""
    data = ctypes.create_string_buffer(packet, len(packet))
    out = ctypes.create_string_buffer(len(packet) + 256)
    opts = TestRunOpts(data_in=ctypes.addressof(data), data_size_in=len(packet), data_out=ctypes.addressof(out),
                       data_size_out=len(out), repeat=repeat)
    prog_test_run(prog_fd, opts)
    return RunResult(ctypes.c_int32(opts.retval).value, int(opts.duration))
