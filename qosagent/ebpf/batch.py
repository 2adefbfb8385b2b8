"""Reading whole BPF hash maps a chunk of entries per syscall (BPF_MAP_LOOKUP_BATCH).

bcc 0.26's own batch reader shares one counter for the batch token and the count and allocates max_entries
buffers on every call; this one reuses a fixed chunk and hands out the raw key and value bytes of each chunk, so that
callers unpack a whole chunk at once instead of building a ctypes object per entry (the agent reads its histograms
every tick, under the load it measures).
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
