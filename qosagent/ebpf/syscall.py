"""The few bpf() commands bcc does not wrap, through ctypes: open a pin, describe a map or program, test-run, link."""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_BPF = 321  # x86_64
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_TEST_RUN = 10
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_LINK_CREATE = 28
BPF_ENABLE_STATS = 32
# enum bpf_attach_type (UAPI)
ATTACH_CGROUP_INET_INGRESS = 0
ATTACH_CGROUP_INET_EGRESS = 1
ATTACH_CGROUP_SOCK_OPS = 3


def bpf(cmd: int, attr: ctypes.Structure) -> int:
    """One bpf() call; raises OSError with the errno the kernel gave."""
    ret = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


class _ObjAttr(ctypes.Structure):
    """BPF_OBJ_PIN and BPF_OBJ_GET share one attribute layout."""

    _fields_ = [("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32), ("file_flags", ctypes.c_uint32),
                ("path_fd", ctypes.c_int32)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _MapInfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16)]


class _ProgInfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("tag", ctypes.c_uint8 * 8),
                ("jited_prog_len", ctypes.c_uint32), ("xlated_prog_len", ctypes.c_uint32),
                ("jited_prog_insns", ctypes.c_uint64), ("xlated_prog_insns", ctypes.c_uint64),
                ("load_time", ctypes.c_uint64), ("created_by_uid", ctypes.c_uint32), ("nr_map_ids", ctypes.c_uint32),
                ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32),
                ("gpl_compatible", ctypes.c_uint32), ("netns_dev", ctypes.c_uint64), ("netns_ino", ctypes.c_uint64),
                ("nr_jited_ksyms", ctypes.c_uint32), ("nr_jited_func_lens", ctypes.c_uint32),
                ("jited_ksyms", ctypes.c_uint64), ("jited_func_lens", ctypes.c_uint64), ("btf_id", ctypes.c_uint32),
                ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
                ("nr_func_info", ctypes.c_uint32), ("nr_line_info", ctypes.c_uint32), ("line_info", ctypes.c_uint64),
                ("jited_line_info", ctypes.c_uint64), ("nr_jited_line_info", ctypes.c_uint32),
                ("line_info_rec_size", ctypes.c_uint32), ("jited_line_info_rec_size", ctypes.c_uint32),
                ("nr_prog_tags", ctypes.c_uint32), ("prog_tags", ctypes.c_uint64), ("run_time_ns", ctypes.c_uint64),
                ("run_cnt", ctypes.c_uint64)]


def obj_get(path: str) -> int:
    """An fd for the object pinned at path (caller closes it)."""
    p = ctypes.create_string_buffer(path.encode())
    attr = _ObjAttr(pathname=ctypes.addressof(p))
    return bpf(BPF_OBJ_GET, attr)


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def map_info(fd: int) -> MapInfo:
    info = _MapInfo()
    bpf(BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return MapInfo(info.type, info.id, info.key_size, info.value_size, info.max_entries, info.map_flags,
                   info.name.decode(errors="replace"))


def prog_id(fd: int) -> int:
    info = _ProgInfo()
    bpf(BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return int(info.id)


def prog_run_count(fd: int) -> int:
    """How many times the program ran while the kernel's BPF run statistics were on (enable_stats)."""
    info = _ProgInfo()
    bpf(BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return int(info.run_cnt)


class _StatsAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32)]


def enable_stats() -> int:
    """BPF_ENABLE_STATS (5.8): programs count their runs (and time them, ~75 ns each) until the fd is closed."""
    return bpf(BPF_ENABLE_STATS, _StatsAttr(type=0))  # BPF_STATS_RUN_TIME


def pinned_map_info(path: str) -> MapInfo:
    fd = obj_get(path)
    try:
        return map_info(fd)
    finally:
        os.close(fd)


class _ElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def obj_pin(fd: int, path: str) -> None:
    p = ctypes.create_string_buffer(path.encode())
    bpf(BPF_OBJ_PIN, _ObjAttr(pathname=ctypes.addressof(p), bpf_fd=fd))


def map_items(fd: int, key_size: int, value_size: int) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a (non-per-CPU) map as raw bytes; for reading pins without compiling a program."""
    out = []
    prev = None
    key = ctypes.create_string_buffer(key_size)
    val = ctypes.create_string_buffer(max(value_size, 1))
    while True:
        attr = _ElemAttr(map_fd=fd, key=ctypes.addressof(prev) if prev is not None else 0,
                         value=ctypes.addressof(key))
        try:
            bpf(BPF_MAP_GET_NEXT_KEY, attr)
        except OSError as e:
            if e.errno == errno.ENOENT:  # the end
                return out
            raise
        try:
            bpf(BPF_MAP_LOOKUP_ELEM, _ElemAttr(map_fd=fd, key=ctypes.addressof(key), value=ctypes.addressof(val)))
        except OSError as e:
            if e.errno != errno.ENOENT:  # deleted meanwhile
                raise
        else:
            out.append((key.raw, val.raw[:value_size]))
        prev = ctypes.create_string_buffer(key.raw, key_size)


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value_size)
    try:
        bpf(BPF_MAP_LOOKUP_ELEM, _ElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(v)))
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        raise
    return v.raw


def map_update(fd: int, key: bytes, value: bytes) -> None:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value, len(value))
    bpf(BPF_MAP_UPDATE_ELEM, _ElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(v)))


class _LinkCreateAttr(ctypes.Structure):
    # After flags comes a union of per-target options (tracing cookies, netfilter hooks...); cgroup links use none,
    # and zeros there are what the kernel requires of every byte a command does not use.
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("union", ctypes.c_uint8 * 48)]


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """A BPF link fd (caller owns it): the attachment lasts exactly as long as the last fd on the link.

    Unlike BPF_PROG_ATTACH, nothing outlives a killed agent, so a crash cannot leave programs on the host.
    """
    return bpf(BPF_LINK_CREATE, _LinkCreateAttr(prog_fd=prog_fd, target_fd=target_fd, attach_type=attach_type))
