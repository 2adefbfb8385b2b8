"""The kernel's bpf() commands that bcc does not wrap, called through libbpf's exported functions.

libbpf is the library bcc itself links (Debian's libbpfcc depends on libbpf1; an upstream bcc build carries it
inside libbcc). Going through it rather than syscall(2) leaves the syscall number and the command numbers to the
library built for this machine, so the same code runs on x86-64 and arm64. Maps are reached through
`qosagent.ebpf.maps`, built on the functions here.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

# enum bpf_attach_type (UAPI)
ATTACH_CGROUP_INET_INGRESS = 0
ATTACH_CGROUP_INET_EGRESS = 1
ATTACH_CGROUP_SOCK_OPS = 3

# Where libbpf's API may be found: the shared library, else bcc's own when it was built with libbpf inside.
_LIBRARIES = ("libbpf.so.1", "libbpf.so.0", "libbpf.so", "libbcc.so.0")
# What the agent cannot run without. bpf_prog_test_run_opts (libbpf 0.7) serves only the tests and benchmarks:
# asking for it made the agent refuse Ubuntu 22.04's libbpf 0.5, which has everything the agent itself calls.
_NEEDED = ("bpf_obj_get", "bpf_map_lookup_batch", "bpf_link_create")


class LibbpfMissing(OSError):
    pass


_c_int, _c_void_p, _c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "bpf_map_lookup_elem": (_c_int, _c_void_p, _c_void_p),
    "bpf_map_update_elem": (_c_int, _c_void_p, _c_void_p, _u64),
    "bpf_map_delete_elem": (_c_int, _c_void_p),
    "bpf_map_get_next_key": (_c_int, _c_void_p, _c_void_p),
    "bpf_map_lookup_batch": (_c_int, _c_void_p, _c_void_p, _c_void_p, _c_void_p, ctypes.POINTER(_u32), _c_void_p),
    "bpf_obj_get": (_c_char_p,),
    "bpf_obj_pin": (_c_int, _c_char_p),
    "bpf_obj_get_info_by_fd": (_c_int, _c_void_p, ctypes.POINTER(_u32)),
    "bpf_link_create": (_c_int, _c_int, _u32, _c_void_p),
    "bpf_prog_test_run_opts": (_c_int, _c_void_p),
    "libbpf_num_possible_cpus": (),
    "bpf_enable_stats": (_c_int,),
    "bpf_raw_tracepoint_open": (_c_char_p, _c_int),
    "bpf_map_create": (_c_int, _c_char_p, _u32, _u32, _u32, _c_void_p),
    "ring_buffer__poll": (_c_void_p, _c_int),
    "ring_buffer__consume": (_c_void_p,),
    "ring_buffer__epoll_fd": (_c_void_p,),
    "bpf_map_update_batch": (_c_int, _c_void_p, _c_void_p, ctypes.POINTER(_u32), _c_void_p),
}


@functools.lru_cache(maxsize=1)
def lib() -> Any:
    """The first library that exports libbpf's API, with the argument types set; LibbpfMissing names what to
    install when none does."""
    tried = []
    for name in _LIBRARIES:
        try:
            so = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            tried.append(f"{name}: {e}")
            continue
        if all(hasattr(so, f) for f in _NEEDED):
            for fn, args in _SIGNATURES.items():
                f = getattr(so, fn, None)
                if f is not None:  # an older libbpf's missing extras are refused by call(), by name
                    f.argtypes, f.restype = list(args), ctypes.c_int
            if hasattr(so, "ring_buffer__new"):
                so.ring_buffer__new.argtypes = [_c_int, _c_void_p, _c_void_p, _c_void_p]
                so.ring_buffer__new.restype = _c_void_p
                so.ring_buffer__free.argtypes, so.ring_buffer__free.restype = [_c_void_p], None
            return so
        tried.append(f"{name}: no libbpf API in it")
    raise LibbpfMissing(f"libbpf (1.x) not found, needed to reach BPF maps: install libbpf1 ({'; '.join(tried)})")


def call(fn: str, *args: Any) -> int:
    """libbpf's fn; its negative return as OSError with the errno (libbpf 1.x returns -errno and sets errno;
    0.x returns -1 and sets errno)."""
    f = getattr(lib(), fn, None)
    if f is None:
        raise LibbpfMissing(f"{fn} is not in this libbpf (an older one); install libbpf1 (1.x) for it")
    ret = f(*args)
    if ret < 0:
        err = ctypes.get_errno() or -ret
        raise OSError(err, f"{fn}: {os.strerror(err)}")
    return int(ret)


def obj_get(path: str) -> int:
    """An fd for the object pinned at path (caller closes it)."""
    return call("bpf_obj_get", path.encode())


def obj_pin(fd: int, path: str) -> None:
    call("bpf_obj_pin", fd, path.encode())


def possible_cpus() -> int:
    """The kernel's possible CPUs: a per-CPU map's value holds one copy for each."""
    return call("libbpf_num_possible_cpus")


class _MapInfo(ctypes.Structure):  # the head of UAPI struct bpf_map_info; the kernel fills what info_len holds
    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16)]


class _ProgInfo(ctypes.Structure):  # the head of UAPI struct bpf_prog_info, through run_cnt (5.1)
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


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def _info(fd: int, info: ctypes.Structure) -> None:
    n = ctypes.c_uint32(ctypes.sizeof(info))
    call("bpf_obj_get_info_by_fd", fd, ctypes.byref(info), ctypes.byref(n))


def map_info(fd: int) -> MapInfo:
    i = _MapInfo()
    _info(fd, i)
    return MapInfo(i.type, i.id, i.key_size, i.value_size, i.max_entries, i.map_flags, i.name.decode(errors="replace"))


def pinned_map_info(path: str) -> MapInfo:
    fd = obj_get(path)
    try:
        return map_info(fd)
    finally:
        os.close(fd)


def prog_id(fd: int) -> int:
    i = _ProgInfo()
    _info(fd, i)
    return int(i.id)


def prog_type(fd: int) -> int:
    """The program's type (enum bpf_prog_type); OSError when fd is no program."""
    i = _ProgInfo()
    _info(fd, i)
    return int(i.type)


def raw_tracepoint_open(name: str, prog_fd: int) -> int:
    """The program on the raw tracepoint `name`, attached while the returned fd is open."""
    return call("bpf_raw_tracepoint_open", name.encode(), prog_fd)


def map_create(map_type: int, name: str, key_size: int, value_size: int, max_entries: int) -> int:
    return call("bpf_map_create", map_type, name.encode(), key_size, value_size, max_entries, None)


# The ring buffer's sample callback: int (*)(void *ctx, void *data, size_t size)
RING_SAMPLE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class RingBuffer:
    """libbpf's consumer of one BPF ring buffer map: poll() calls `on_sample(data pointer, size)` per record."""

    def __init__(self, map_fd: int, on_sample: Any):
        def sample(_ctx: Any, data: Any, size: int) -> int:
            on_sample(data, size)
            return 0

        self._cb = RING_SAMPLE(sample)  # held: libbpf keeps the pointer
        ptr = lib().ring_buffer__new(map_fd, ctypes.cast(self._cb, ctypes.c_void_p), None, None)
        if not ptr:
            err = ctypes.get_errno()
            raise OSError(err, f"ring_buffer__new: {os.strerror(err)}")
        self._rb: int | None = ptr

    def poll(self, timeout_ms: int) -> int:
        if self._rb is None:
            return 0
        return call("ring_buffer__poll", self._rb, timeout_ms)

    def epoll_fd(self) -> int:
        """The epoll instance libbpf waits on: readable while a record waits, so a caller can wait on it beside
        fds of its own (select.poll) and then consume()."""
        assert self._rb is not None
        return call("ring_buffer__epoll_fd", self._rb)

    def consume(self) -> int:
        """Hand every record waiting to on_sample, without waiting for more."""
        if self._rb is None:
            return 0
        return call("ring_buffer__consume", self._rb)

    def close(self) -> None:
        if self._rb is not None:
            lib().ring_buffer__free(self._rb)
            self._rb = None


def prog_run_count(fd: int) -> int:
    """How many times the program ran while the kernel's BPF run statistics were on (enable_stats)."""
    i = _ProgInfo()
    _info(fd, i)
    return int(i.run_cnt)


BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type (UAPI)


def enable_stats() -> int:
    """BPF_ENABLE_STATS (5.8): programs count their runs (and time them, ~75 ns each) until the fd is closed."""
    return call("bpf_enable_stats", BPF_STATS_RUN_TIME)


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """A BPF link fd (caller owns it): the attachment lasts exactly as long as the last fd on the link.

    Unlike BPF_PROG_ATTACH, nothing outlives a killed agent, so a crash cannot leave programs on the host.
    """
    return call("bpf_link_create", prog_fd, target_fd, attach_type, None)


class TestRunOpts(ctypes.Structure):
    """libbpf's struct bpf_test_run_opts (its `sz` lets the library accept a struct of an older or newer libbpf)."""

    __test__ = False  # not a pytest class
    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
                ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32), ("ctx_in", ctypes.c_void_p),
                ("ctx_out", ctypes.c_void_p), ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
                ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32)]


def prog_test_run(prog_fd: int, opts: TestRunOpts) -> None:
    opts.sz = ctypes.sizeof(opts)
    call("bpf_prog_test_run_opts", prog_fd, ctypes.byref(opts))
