"""ebpf.maps on real maps: typed single-entry access, sync (the one way a map is made to hold the config), per-CPU
values, pins opened by path, batch reads of a hash map."""

from __future__ import annotations

import ctypes
import os
import secrets
from typing import Any, Iterator

import pytest

from qosagent.ebpf import libbpf
from qosagent.ebpf.maps import BatchReader, Map, percpu, sync
from qosagent.ebpf.tenant_ports import CidrKey, cidr_key, sync_cidrs
from qosagent.tenants import CidrEntry

PROG = b"""
struct key { __u32 id; __u32 pad; };
struct val { __u64 n; };
struct qos_cidr_key { __u32 prefixlen; __u16 port; __u8 addr[16]; } __attribute__((packed));
struct qos_tenant_val { __u32 tenant; };
BPF_HASH(h, struct key, struct val, 1024);
BPF_PERCPU_ARRAY(pc, struct val, 4);
BPF_F_TABLE("lpm_trie", struct qos_cidr_key, struct qos_tenant_val, cidrs, 64, BPF_F_NO_PREALLOC);
"""


@pytest.fixture
def prog(bpf: None) -> Iterator[Any]:
    from bcc import BPF

    b = BPF(text=PROG)
    try:
        yield b
    finally:
        b.cleanup()


def test_single_entries_and_sync(prog: Any) -> None:
    m = Map.of(prog, "h")
    assert m.lookup(m.key(id=1)) is None and m.delete(m.key(id=1)) is False
    m.update(m.key(id=1), m.value(n=10))
    assert m.lookup(m.key(id=1)).n == 10
    # sync: 1 changes, 2 is new, 3 (written outside the config) goes; a second sync changes nothing.
    m.update(m.key(id=3), m.value(n=30))
    want = [(m.key(id=1), m.value(n=11)), (m.key(id=2), m.value(n=20))]
    assert sync(m, want) is True
    assert sorted((k.id, v.n) for k, v in m.items()) == [(1, 11), (2, 20)]
    assert sync(m, want) is False
    m.clear()
    assert m.keys() == []


def test_per_cpu_values_hold_one_copy_per_possible_cpu(prog: Any) -> None:
    m = Map.of(prog, "pc")
    assert ctypes.sizeof(m.value) == ctypes.sizeof(percpu(ctypes.c_uint64)) == 8 * libbpf.possible_cpus()
    v = m.value()
    for i in range(len(v)):
        v[i].n = i + 1
    m.update(2, v)
    assert [c.n for c in m.lookup(2)] == list(range(1, libbpf.possible_cpus() + 1))
    m.zero(2)
    assert sum(c.n for c in m.lookup(2)) == 0


def test_cidr_keys_are_built_once_and_match_the_trie(prog: Any) -> None:
    m = Map.of(prog, "cidrs")
    e = CidrEntry(16 + 96 + 24, 8000, b"\0" * 10 + b"\xff\xff" + bytes([10, 1, 2, 0]), 7)
    assert sync_cidrs(m, [e]) is True and sync_cidrs(m, [e]) is False
    k = cidr_key(e)
    assert bytes(k)[4:6] == (8000).to_bytes(2, "big")  # the port in network byte order, first in the prefix
    # A host inside the /24 on that port resolves to the tenant: the kernel's longest-prefix match on our key.
    probe = CidrKey(prefixlen=16 + 128, port=k.port)
    ctypes.memmove(probe.addr, e.addr[:15] + b"\x09", 16)
    assert m.lookup(bytes(probe)).tenant == 7
    assert sync_cidrs(m, []) is True and m.keys() == []


def test_pinned_maps_open_by_path_and_batch_read(prog: Any) -> None:
    m = Map.of(prog, "h")
    for i in range(300):
        m.update(m.key(id=i), m.value(n=i))
    path = f"/sys/fs/bpf/qosagent-test-{secrets.token_hex(4)}"
    libbpf.obj_pin(m.fd, path)
    try:
        info = libbpf.pinned_map_info(path)
        assert (info.key_size, info.value_size, info.max_entries) == (8, 8, 1024)
        with Map.pinned(path, m.key, m.value) as p:
            assert p.lookup(m.key(id=299)).n == 299
            seen = 0
            for keys, values, n in BatchReader(p.fd, 8, 8, chunk=64).chunks():
                seen += n
                assert [int.from_bytes(values[i * 8:i * 8 + 8], "little") for i in range(n)] == [
                    int.from_bytes(keys[i * 8:i * 8 + 4], "little") for i in range(n)]
            assert seen == 300
        assert p.fd == -1
    finally:
        os.unlink(path)

