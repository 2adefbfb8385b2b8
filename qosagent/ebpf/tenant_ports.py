"""tenant_ports, the port rule of bpf/include/qos_tenant.h as both programs hold it: a BPF array of QOS_PORTS
entries indexed by the local port, each a struct qos_port_tenant (tenant 0: no single tenant claims the port).

An array has no keys to list and no entries to delete: what was written is remembered (or, for adopted pins, read
back in one batch pass), and a port no longer claimed is written back to zero.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Mapping

from qosagent.ebpf import syscall
from qosagent.ebpf.batch import BatchReader

log = logging.getLogger("qosagent.ebpf")

PORTS = 65536  # QOS_PORTS


class PortTenant(ctypes.Structure):
    _fields_ = [("tenant", ctypes.c_uint32), ("slot", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


Claim = tuple[int, int]  # (tenant id, slot); latency's slots are always 0


def read_claims(fd: int) -> dict[int, Claim]:
    """The claimed ports in the array: BPF_MAP_LOOKUP_BATCH in chunks (16 calls, not QOS_PORTS lookups)."""
    out = {}
    size = ctypes.sizeof(PortTenant)
    for keys, values, n in BatchReader(fd, 4, size, chunk=PORTS // 16).chunks():
        if not values.rstrip(b"\0"):  # most chunks: no port claimed
            continue
        ports = memoryview(keys).cast("I")
        for i in range(n):
            v = PortTenant.from_buffer_copy(values, i * size)
            if v.tenant:
                out[ports[i]] = (v.tenant, v.slot)
    return out


class TenantPorts:
    """One program's tenant_ports: `written` is what the array holds apart from zeroes."""

    def __init__(self, fd: int, written: Mapping[int, Claim] | None = None):
        self.fd = fd
        self.written: dict[int, Claim] = dict(written or {})

    @classmethod
    def adopt(cls, fd: int) -> "TenantPorts":
        """For an array another agent filled (pinned): start from what it wrote."""
        claims = read_claims(fd)
        log.debug("tenant_ports: %d claimed ports read back", len(claims))
        return cls(fd, claims)

    def sync(self, want: Mapping[int, Claim]) -> bool:
        """Make the array hold want: changed claims written, claims not wanted zeroed. True when anything changed.
        `written` follows each write, so a failure part-way leaves it true to the kernel for the next try."""
        changed = False
        for port in sorted(set(self.written) - set(want)):
            self._write(port, PortTenant())
            del self.written[port]
            changed = True
        for port, claim in sorted(want.items()):
            if self.written.get(port) != claim:
                self._write(port, PortTenant(tenant=claim[0], slot=claim[1]))
                self.written[port] = claim
                changed = True
        return changed

    def _write(self, port: int, value: PortTenant) -> None:
        syscall.map_update(self.fd, bytes(ctypes.c_uint32(port)), bytes(value))
