"""Reading whole BPF hash maps a chunk of entries per syscall (BPF_MAP_LOOKUP_BATCH).

bcc 0.26's own batch reader shares one counter for the batch token and the count and allocates max_entries
buffers on every call; this one reuses a fixed chunk and yields raw value bytes for the caller to unpack.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
from typing import Iterator


class BatchReader:
    """Reads every (key, value bytes) of a hash map. `value_size` is the kernel's per-key value size: for per-CPU
    maps, the leaf rounded up to 8 bytes times the possible CPUs."""

    def __init__(self, map_fd: int, key_type: type[ct.Structure], value_size: int, chunk: int = 256):
        from bcc.libbcc import lib

        self._lib = lib
        self.fd = map_fd
        self.key_type = key_type
        self.value_size = value_size
        self._alloc(chunk)

    def _alloc(self, chunk: int) -> None:
        self.chunk = chunk
        self._keys = (self.key_type * chunk)()
        self._values = ct.create_string_buffer(self.value_size * chunk)

    def __iter__(self) -> Iterator[tuple[ct.Structure, bytes]]:
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
            raw = self._values.raw
            vs = self.value_size
            for i in range(count.value):
                key = self.key_type.from_buffer_copy(self._keys[i])
                yield key, raw[i * vs:(i + 1) * vs]
            if res != 0:
                if err == errno.ENOENT:
                    return
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
            token_in.value = token_out.value
            first = False
