"""Reading BPF maps many entries per syscall (BPF_MAP_LOOKUP_BATCH): whole hash maps, and ranges of arrays.

bcc 0.26's own batch reader shares one counter for the batch token and the count and allocates max_entries
buffers on every call; these reuse their buffers and hand out raw value bytes, so that callers unpack them at once
instead of building a ctypes object per entry (the agent reads its histograms every tick, under the load it
measures). Both go through libbcc's bpf_lookup_batch.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
from typing import Iterator


class BatchReader:
    """Reads every entry of a hash map. `key_size` and `value_size` are the kernel's sizes per key: for per-CPU
    maps, the leaf rounded up to 8 bytes times the possible CPUs."""

    def __init__(self, map_fd: int, key_size: int, value_size: int, chunk: int = 256):
        from bcc.libbcc import lib

        self._lib = lib
        self.fd = map_fd
        self.key_size = key_size
        self.value_size = value_size
        self._alloc(chunk)

    def _alloc(self, chunk: int) -> None:
        self.chunk = chunk
        self._keys = ct.create_string_buffer(self.key_size * chunk)
        self._values = ct.create_string_buffer(self.value_size * chunk)

    def chunks(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(keys, values, n) per syscall: n keys of key_size bytes back to back, and their values likewise."""
        token_in = ct.c_uint32(0)
        token_out = ct.c_uint32(0)
        first = True
        while True:
            count = ct.c_uint32(self.chunk)
            res = self._lib.bpf_lookup_batch(self.fd, None if first else ct.byref(token_in), ct.byref(token_out),
                                             self._keys, self._values, ct.byref(count))
            err = ct.get_errno() if res != 0 else 0
            if err == errno.ENOSPC and count.value == 0:
                # One hash bucket holds more entries than the chunk: retry it with room for them.
                self._alloc(self.chunk * 4)
                continue
            n = count.value
            if n:
                yield self._keys.raw[:n * self.key_size], self._values.raw[:n * self.value_size], n
            if res != 0:
                if err == errno.ENOENT:
                    return
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
            token_in.value = token_out.value
            first = False


class ArrayRange:
    """Entries first..first+count-1 of a BPF array in one call. value_size is the kernel's size per entry: for a
    per-CPU array the leaf rounded up to 8 bytes times the possible CPUs. The buffers are made once and reused."""

    def __init__(self, map_fd: int, first: int, count: int, value_size: int):
        from bcc.libbcc import lib

        self._lib = lib
        self.fd, self.first, self.count, self.value_size = map_fd, first, count, value_size
        self._prev = ct.c_uint32(first - 1)  # a batch starts after its in_batch key
        self._out = ct.c_uint32(0)
        self._keys = ct.create_string_buffer(4 * max(count, 1))
        self._values = ct.create_string_buffer(value_size * max(count, 1))

    def read(self) -> list[bytes]:
        """The values in index order."""
        if not self.count:
            return []
        n = ct.c_uint32(self.count)
        res = self._lib.bpf_lookup_batch(self.fd, ct.byref(self._prev) if self.first else None, ct.byref(self._out),
                                         self._keys, self._values, ct.byref(n))
        err = ct.get_errno() if res != 0 else 0
        if err and err != errno.ENOENT:  # ENOENT: the range reaches the array's last entry
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
        if n.value != self.count:
            raise OSError(errno.EIO, f"BPF_MAP_LOOKUP_BATCH read {n.value} of {self.count} entries")
        raw, size = self._values.raw, self.value_size
        return [raw[i * size:(i + 1) * size] for i in range(self.count)]
