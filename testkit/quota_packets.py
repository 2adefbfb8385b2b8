"""Frames for the quota classifier's test runs and benchmark: Ethernet + IPv4/IPv6 + TCP built by hand; a loaded
classifier to run them through."""

from __future__ import annotations

import ipaddress
import struct
import uuid
from contextlib import contextmanager
from typing import Iterator

from qosagent.config import Config
from qosagent.ebpf import pins
from qosagent.ebpf.testrun import test_run
from qosagent.quota import datapath as dp
from qosagent.quota.rules import baseline_buckets
from qosagent.tenants import UNMATCHED_ID, tenant_id

ETH_IP, ETH_IP6 = 0x0800, 0x86DD
SYN, ACK, PSH = 0x02, 0x10, 0x08


def _csum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def tcp(sport: int, dport: int, flags: int = ACK | PSH, payload: bytes = b"", options: bytes = b"") -> bytes:
    doff = (20 + len(options)) // 4
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 1, doff << 4, flags, 65535, 0, 0) + options + payload


def eth(proto: int) -> bytes:
    return b"\x02" * 6 + b"\x04" * 6 + struct.pack("!H", proto)


def ipv4(src: str, dst: str, l4: bytes, options: bytes = b"", frag: int = 0, proto: int = 6,
         tot_len: int | None = None) -> bytes:
    ihl = (20 + len(options)) // 4
    hdr = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, tot_len if tot_len is not None else ihl * 4 + len(l4), 1,
                      frag, 64, proto, 0, ipaddress.IPv4Address(src).packed, ipaddress.IPv4Address(dst).packed)
    hdr += options
    hdr = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
    return eth(ETH_IP) + hdr + l4


def ipv6(src: str, dst: str, l4: bytes, ext: list[tuple[int, bytes]] = (), proto: int = 6) -> bytes:
    """ext: (header type, body) in order; each body is padded to the header's length unit."""
    chain = b""
    types = [t for t, _ in ext] + [proto]
    for i, (t, body) in enumerate(ext):
        nxt = types[i + 1]
        if t == 44:  # fragment: fixed 8 bytes
            chain += bytes([nxt, 0]) + body[:6].ljust(6, b"\0")
        else:
            raw = bytes([nxt, 0]) + body
            raw = raw.ljust(-(-len(raw) // 8) * 8, b"\0")
            chain += bytes([nxt, len(raw) // 8 - 1]) + raw[2:]
    first = types[0]
    payload = chain + l4
    hdr = struct.pack("!IHBB16s16s", 6 << 28, len(payload), first, 64, ipaddress.IPv6Address(src).packed,
                      ipaddress.IPv6Address(dst).packed)
    return eth(ETH_IP6) + hdr + payload


def request(path: str = "/", headers: dict[str, str] | None = None, method: str = "GET") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: server"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@contextmanager
def scratch_pin_root() -> Iterator[str]:
    """A pin root of our own; the classifier's pins under it are removed afterwards, even on failure."""
    root = f"/sys/fs/bpf/qosagent-test-{uuid.uuid4().hex[:8]}"
    try:
        yield root
    finally:
        dp.remove_pins(pins.quota_dir(root))


@contextmanager
def loaded(cfg: Config) -> Iterator[dp.Datapath]:
    """The classifier loaded with cfg's maps written (pins stay: the caller's pin root fixture removes them)."""
    d = dp.Datapath(cfg)
    try:
        d.write_config(cfg, baseline_buckets(cfg))
        yield d
    finally:
        d.close()


def run(d: dp.Datapath, frame: bytes) -> int:
    return test_run(d.prog, frame).retval


def counts(d: dp.Datapath, name: str) -> tuple[int, int, int, int]:
    """A tenant's (requests admitted, dropped, connections admitted, dropped); name "unmatched": no tenant's."""
    return d.read().counts.get(tenant_id(name) if name != "unmatched" else UNMATCHED_ID, (0, 0, 0, 0))
