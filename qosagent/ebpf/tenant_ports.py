"""The tenant maps of bpf/include/qos_tenant.h as both programs hold them.

tenant_ports, the port rule: a BPF array of QOS_PORTS entries indexed by the local port, each a struct
qos_port_tenant (tenant 0: no single tenant claims the port). An array has no keys to list and no entries to
delete: what was written is remembered (or, for adopted pins, read back in one batch pass), and a port no longer
claimed is written back to zero.

tenant_cidrs, the address rule: an LPM trie of struct qos_cidr_key -> struct qos_tenant_val, synced from
`tenants.tenant_entries()` by `sync_cidrs`, the one place its keys are built.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Iterable, Mapping

from qosagent.ebpf.maps import BatchReader, Map, sync
from qosagent.tenants import CidrEntry

log = logging.getLogger("qosagent.ebpf")

PORTS = 65536  # QOS_PORTS


class PortTenant(ctypes.Structure):
    _fields_ = [("tenant", ctypes.c_uint32), ("slot", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


class CidrKey(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("prefixlen", ctypes.c_uint32), ("port", ctypes.c_uint16), ("addr", ctypes.c_uint8 * 16)]


class TenantVal(ctypes.Structure):
    _fields_ = [("tenant", ctypes.c_uint32)]


def cidr_key(e: CidrEntry) -> CidrKey:
    """The trie's key for an entry: the port in network byte order, so that the trie matches it as the first
    CIDR_PORT_BITS of the prefix."""
    key = CidrKey(prefixlen=e.prefixlen, port=int.from_bytes(e.port.to_bytes(2, "big"), "little"))
    ctypes.memmove(key.addr, e.addr, 16)
    return key


def sync_cidrs(m: Map, entries: Iterable[CidrEntry]) -> bool:
    """Make tenant_cidrs hold exactly these entries; True when anything changed."""
    return sync(m, ((bytes(cidr_key(e)), bytes(TenantVal(e.tenant))) for e in entries))


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
        self._map = Map(fd, ctypes.c_uint32, PortTenant, "tenant_ports")
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
        self._map.update(port, value)
