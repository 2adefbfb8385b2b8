"""The one way the agent reads and writes BPF maps: by fd (a program bcc loaded) or by pinned path, one entry at a
time or many per syscall (BPF_MAP_LOOKUP_BATCH), all through libbpf (`qosagent.ebpf.libbpf`).

A `Map` carries the ctypes types of its key and value: for a program bcc compiled, the types bcc generated from the
C (`Map.of`); for a pin read without compiling, the mirrors in `qosagent/quota/layout.py` and
`qosagent/ebpf/tenant_ports.py` (checked against the headers by tests/unit/test_bpf_layouts.py). `sync()` is the
one way a map is made to hold what the config says.
"""

from __future__ import annotations

import collections
import ctypes as ct
import errno
import itertools
import mmap
import operator
import os
from typing import Any, Iterable, Iterator

from qosagent.ebpf.libbpf import call, lib, map_info, obj_get, possible_cpus

BPF_ANY = 0

# Entries written or deleted through this module since the agent started, by map name: what a reload touched (tests
# and bench/scale_tenants.py compare it before and after).
writes: collections.Counter[str] = collections.Counter()


def percpu(value: Any) -> Any:
    """The value type of a per-CPU map of `value`: one copy per possible CPU, each rounded up to 8 bytes."""
    size = ct.sizeof(value)
    if size % 8:
        value = ct.c_uint8 * (size + 8 - size % 8)
    return value * possible_cpus()


def _as(typ: Any, v: Any) -> Any:
    if isinstance(v, typ):
        return v
    if isinstance(v, (bytes, bytearray)):
        return typ.from_buffer_copy(v)
    return typ(v)


class Map:
    """One BPF map: `key` and `value` are its ctypes types (for a per-CPU map, `value` is `percpu(leaf)`).

    Keys and values are passed as instances of those types, as bytes of their size, or as anything the type's
    constructor takes (an int for a scalar key)."""

    def __init__(self, fd: int, key: Any, value: Any, name: str = "", *, owned: bool = False):
        self.fd, self.key, self.value, self.name = fd, key, value, name
        self._owned = owned

    @classmethod
    def of(cls, bpf: Any, name: str) -> "Map":
        """A map of a program bcc loaded, typed as bcc generated it from the C (bcc keeps the fd)."""
        t = bpf[name.encode()]
        return cls(t.map_fd, t.Key, t.Leaf, name)

    @classmethod
    def pinned(cls, path: str, key: Any, value: Any) -> "Map":
        """The map pinned at path; close it (or use it as a context manager)."""
        return cls(obj_get(path), key, value, os.path.basename(path), owned=True)

    def close(self) -> None:
        if self._owned and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Map":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def lookup(self, key: Any) -> Any:
        """The value at key, or None when there is none."""
        k, v = _as(self.key, key), self.value()
        try:
            call("bpf_map_lookup_elem", self.fd, ct.byref(k), ct.byref(v))
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return v

    def update(self, key: Any, value: Any, flags: int = BPF_ANY) -> None:
        k, v = _as(self.key, key), _as(self.value, value)
        call("bpf_map_update_elem", self.fd, ct.byref(k), ct.byref(v), flags)
        writes[self.name] += 1

    def delete(self, key: Any) -> bool:
        """False when there was no such key."""
        k = _as(self.key, key)
        try:
            call("bpf_map_delete_elem", self.fd, ct.byref(k))
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        writes[self.name] += 1
        return True

    def zero(self, key: Any) -> None:
        """An array entry back to zeroes (arrays have no delete)."""
        self.update(key, self.value())

    def keys(self) -> list[Any]:
        """Every key, listed before any is returned, so that the caller may delete while going through them."""
        out: list[Any] = []
        prev = None
        while True:
            nxt = self.key()
            try:
                call("bpf_map_get_next_key", self.fd, None if prev is None else ct.byref(prev), ct.byref(nxt))
            except OSError as e:
                if e.errno == errno.ENOENT:  # the end
                    return out
                raise
            out.append(nxt)
            prev = nxt

    def items(self) -> list[tuple[Any, Any]]:
        """(key, value) of every entry, one lookup each (entries deleted meanwhile left out); for maps too small to
        be worth a batch, or of a kind that has none."""
        out = []
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:
                out.append((k, v))
        return out

    def clear(self) -> None:
        """Every entry of a hash-like map deleted."""
        for k in self.keys():
            self.delete(k)

    def zero_all(self, entries: int, chunk: int = 4096) -> None:
        """Every entry of an array (of `entries`) back to zeroes, `chunk` per BPF_MAP_UPDATE_BATCH."""
        size = ct.sizeof(self.value)
        for first in range(0, entries, chunk):
            n = min(chunk, entries - first)
            keys = (ct.c_uint32 * n)(*range(first, first + n))
            count = ct.c_uint32(n)
            call("bpf_map_update_batch", self.fd, keys, ct.create_string_buffer(size * n), ct.byref(count), None)


def sync(m: Map, want: Iterable[tuple[Any, Any]]) -> bool:
    """Make a hash-like map (hash, LRU, LPM trie) hold exactly `want`, in place: entries not wanted deleted, new or
    changed ones written, equal ones left alone. True when anything changed. Keys compare by their bytes."""
    wanted = {}
    for k, v in want:
        key = _as(m.key, k)
        wanted[bytes(key)] = (key, _as(m.value, v))
    changed = False
    for k in m.keys():
        if bytes(k) not in wanted:
            changed |= m.delete(k)
    for key, value in wanted.values():
        cur = m.lookup(key)
        if cur is None or bytes(cur) != bytes(value):
            m.update(key, value)
            changed = True
    return changed


def _lookup_batch(fd: int, in_batch: Any, out_batch: Any, keys: Any, values: Any, count: Any) -> int:
    """One BPF_MAP_LOOKUP_BATCH: 0, or the errno (ENOENT: the map's end reached; entries may still have come).
    Called every tick: the library's function directly, no exception for the expected ENOENT."""
    ret = lib().bpf_map_lookup_batch(fd, in_batch, out_batch, keys, values, count, None)
    return 0 if ret >= 0 else (ct.get_errno() or -ret)


class BatchReader:
    """Reads every entry of a hash map or array, many per syscall, as raw bytes. `key_size` and `value_size` are
    the kernel's sizes per entry: for per-CPU maps, the leaf rounded up to 8 bytes times the possible CPUs. The
    buffers are reused, and values handed out as bytes, so that callers unpack them at once instead of building a
    ctypes object per entry."""

    def __init__(self, map_fd: int, key_size: int, value_size: int, chunk: int = 256):
        self.fd, self.key_size, self.value_size = map_fd, key_size, value_size
        self._alloc(chunk)

    def _alloc(self, chunk: int) -> None:
        self.chunk = chunk
        self._keys = ct.create_string_buffer(self.key_size * chunk)
        self._values = ct.create_string_buffer(self.value_size * chunk)

    def chunks(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(keys, values, n) per syscall: n keys of key_size bytes back to back, and their values likewise."""
        token_in = ct.create_string_buffer(max(self.key_size, 8))
        token_out = ct.create_string_buffer(max(self.key_size, 8))
        first = True
        while True:
            count = ct.c_uint32(self.chunk)
            err = _lookup_batch(self.fd, None if first else token_in, token_out, self._keys, self._values,
                                ct.byref(count))
            if err == errno.ENOSPC and count.value == 0:
                # One hash bucket holds more entries than the chunk: retry it with room for them.
                self._alloc(self.chunk * 4)
                continue
            n = count.value
            if n:
                yield self._keys.raw[:n * self.key_size], self._values.raw[:n * self.value_size], n
            if err:
                if err == errno.ENOENT:
                    return
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
            ct.memmove(token_in, token_out, len(token_out))
            first = False


class ArrayRange:
    """Entries first..first+count-1 of a BPF array in one call. value_size is the kernel's size per entry: for a
    per-CPU array the leaf rounded up to 8 bytes times the possible CPUs. The buffers are made once and reused, by
    `at` too, which reads another range of the same array in them."""

    def __init__(self, map_fd: int, first: int, count: int, value_size: int):
        self.fd, self.first, self.count, self.value_size = map_fd, first, count, value_size
        self._prev = ct.c_uint32(0)  # a batch starts after its in_batch key
        self._out = ct.c_uint32(0)
        self._n = ct.c_uint32(0)
        self._keys = ct.create_string_buffer(4 * max(count, 1))
        self._values = ct.create_string_buffer(value_size * max(count, 1))

    def read(self) -> list[bytes]:
        """The values in index order."""
        raw, size = self.data(), self.value_size
        return [raw[i * size:(i + 1) * size] for i in range(self.count)]

    def data(self) -> bytes:
        """The values in index order, back to back."""
        return self.at(self.first, self.count)

    def at(self, first: int, count: int) -> bytes:
        """Entries first..first+count-1 of the same array, back to back: in this range's buffers where they hold
        that many (a tick's short runs of slots, wherever they fall, read without buffers made for each), else in
        buffers made for this read alone."""
        if count > self.count:
            return ArrayRange(self.fd, first, count, self.value_size).data()
        if not count:
            return b""
        self._prev.value, self._n.value = max(first - 1, 0), count
        err = _lookup_batch(self.fd, ct.byref(self._prev) if first else None, ct.byref(self._out),
                            self._keys, self._values, ct.byref(self._n))
        if err and err != errno.ENOENT:  # ENOENT: the range reaches the array's last entry
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
        if self._n.value != count:
            raise OSError(errno.EIO, f"BPF_MAP_LOOKUP_BATCH read {self._n.value} of {count} entries")
        return ct.string_at(self._values, count * self.value_size)


# A tick's run of moved slots up to this long is read in buffers its reader keeps (ArrayRange.at); a longer one, as
# a first read of every slot, in buffers made for that read.
RUN_SLOTS = 16
GEN_SIZE = 8  # struct qos_gen (bpf/include/qos_common.h)
BPF_F_MMAPABLE = 1 << 10  # linux/bpf.h
_GEN_BLOCK = 64 * GEN_SIZE
_GEN_SUB = 8 * GEN_SIZE


def moved(new: bytes, old: bytes) -> list[int]:
    """The indexes of the generations (8 bytes each) that differ between two reads; old may be shorter (slots added
    since), its missing entries zero. Compared a block of 64 at a time (most blocks of most ticks are equal), then
    eight at a time within a block that differs, then one by one within those eight: a slot that moved costs about
    ten compares, not the 64 of its block."""
    if len(old) < len(new):
        old += bytes(len(new) - len(old))
    if new == old:
        return []
    n = len(new)
    new_q, old_q = memoryview(new).cast("Q"), memoryview(old).cast("Q")[:n // GEN_SIZE]
    out: list[int] = []
    for off in range(0, n, _GEN_BLOCK):
        end = min(off + _GEN_BLOCK, n)
        if new[off:end] == old[off:end]:
            continue
        for sub in range(off, end, _GEN_SUB):
            top = min(sub + _GEN_SUB, end)
            if new[sub:top] != old[sub:top]:
                a, b = sub // GEN_SIZE, top // GEN_SIZE
                out.extend(itertools.compress(range(a, b), map(operator.ne, new_q[a:b], old_q[a:b])))
    return out


def runs(indexes: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indexes as (first, count) runs of consecutive ones: one batch read each."""
    out: list[tuple[int, int]] = []
    for i in sorted(indexes):
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


class Generations:
    """A BPF array of slot generations (struct qos_gen, bpf/include/qos_common.h), which the programs bump after each
    change to a slot: `changed()` says which of slots first..first+count-1 to read this tick. Those whose generation
    moved since the last read, and those whose generation moved at the read before it, once more (the bump may be
    seen before the change it marks on a CPU with relaxed atomics). `everything` makes the first read name every
    slot (counts that were there before the generations, such as an adopted program's).

    The array is BPF_F_MMAPABLE and mapped read-only into the agent: a tick copies the slots' 8 bytes each out of
    its own memory instead of a BPF_MAP_LOOKUP_BATCH, which cost ~0.13 us per slot in the kernel."""

    def __init__(self, map_fd: int, first: int, count: int, everything: bool = False):
        info = map_info(map_fd)
        if not info.flags & BPF_F_MMAPABLE:
            raise OSError(errno.EINVAL, f"generations map {info.name!r} is not BPF_F_MMAPABLE")
        self._begin(mmap.mmap(map_fd, info.max_entries * GEN_SIZE, mmap.MAP_SHARED, mmap.PROT_READ), first, count,
                    everything)

    @classmethod
    def over(cls, mem: Any, first: int, count: int, everything: bool = False) -> "Generations":
        """The same over memory the caller holds: a test's bytearray standing for the mapped array, written as the
        programs would bump it."""
        g = cls.__new__(cls)
        g._begin(mem, first, count, everything)
        return g

    def _begin(self, mem: Any, first: int, count: int, everything: bool) -> None:
        self.first, self.count = first, count
        self._mem = mem
        self._last: bytes | None = b"" if not everything else None
        self._settling: set[int] = set()

    def resize(self, count: int) -> None:
        """Slots added (a reload): they start from zero, as the kernel's do."""
        self.count = count

    def changed(self) -> set[int]:
        gens = self._mem[self.first * GEN_SIZE:(self.first + self.count) * GEN_SIZE]
        if self._last is None:
            now = list(range(self.count))
        else:
            now = moved(gens, self._last)
        out = set(now) | self._settling
        self._last, self._settling = gens, set(now)
        return {self.first + i for i in out}

    def close(self) -> None:
        if isinstance(self._mem, mmap.mmap):
            self._mem.close()
