"""Whether the running kernel's verifier accepts BPF's atomic operations (compare-and-exchange, exchange, fetch-add:
BPF_ATOMIC with a non-zero operation, Linux 5.12). The agent's BPF C uses them (`__sync_val_compare_and_swap`,
`__sync_lock_test_and_set`), so on an older kernel every latency and quota program is refused by the verifier
("BPF_STX uses reserved fields") after seconds of compiling; asking the kernel first lets the agent say so in one
line before anything is compiled.

The question goes to the kernel itself, not to its version (a distro may backport the feature): a six-instruction
socket filter with one compare-and-exchange on its stack, loaded and closed at once. BPF_PROG_LOAD has no wrapper
that both libbpf 0.x and 1.x export under one signature, so this calls bpf(2) by number (`qosagent/syscall.py`),
as `ebpf/perf.py` does perf_event_open.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Literal

from qosagent import syscall

_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280}
_BPF_PROG_LOAD = 5
_BPF_PROG_TYPE_SOCKET_FILTER = 1

Answer = Literal["yes", "no", "unknown"]
REFUSAL = "BPF atomic operations (compare-and-exchange, exchange: Linux 5.12+)"


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One struct bpf_insn (UAPI): opcode, dst and src registers in one byte (dst in the low nibble), offset, imm."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


_R0, _R1, _R10 = 0, 1, 10
PROGRAM = b"".join((
    _insn(0x7A, _R10, off=-8),  # *(u64 *)(r10 - 8) = 0             BPF_ST | BPF_MEM | BPF_DW
    _insn(0xB7, _R0),  # r0 = 0                                       BPF_ALU64 | BPF_MOV | BPF_K
    _insn(0xB7, _R1, imm=1),  # r1 = 1
    _insn(0xDB, _R10, _R1, off=-8, imm=0xF1),  # r0 = cmpxchg(r10 - 8, r0, r1)   BPF_STX | BPF_ATOMIC | BPF_DW,
    #                                                                 BPF_CMPXCHG (0xf0 | BPF_FETCH)
    _insn(0xB7, _R0),  # r0 = 0
    _insn(0x95),  # exit
))


class _ProgLoad(ctypes.Structure):
    """The head of union bpf_attr for BPF_PROG_LOAD through prog_flags; the size passed tells the kernel where it
    ends (the rest reads as zero)."""

    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32)]


def _load(program: bytes) -> int:
    """bpf(BPF_PROG_LOAD) of a socket filter: its fd, or -errno."""
    insns = ctypes.create_string_buffer(program, len(program))
    license = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoad(prog_type=_BPF_PROG_TYPE_SOCKET_FILTER, insn_cnt=len(program) // 8,
                     insns=ctypes.addressof(insns), license=ctypes.addressof(license))
    try:
        return syscall.call("bpf(BPF_PROG_LOAD)", _BPF, ctypes.c_int(_BPF_PROG_LOAD), ctypes.byref(attr),
                            ctypes.c_uint(ctypes.sizeof(attr)))
    except OSError as e:
        return -(e.errno or errno.ENOSYS)


def supported() -> Answer:
    """"yes" when the verifier accepts the program; "no" when it refuses it (EINVAL: the operation is a reserved
    field to it); "unknown" when the kernel would not say (no privilege to load, no bpf(2) here)."""
    fd = _load(PROGRAM)
    if fd >= 0:
        os.close(fd)
        return "yes"
    return "no" if fd == -errno.EINVAL else "unknown"
