"""Process tenants in latency, the parts without BPF: which (address, port) entries lat_netns holds for the serving
namespaces found, an address two namespaces share left out rather than guessed, the map kept in step as namespaces
come and go, and connections already open in a pod listed from its own /proc entries."""

from __future__ import annotations

import ctypes
import logging
import struct

from qosagent.latency import adopt
from qosagent.pods.config import PodsConfig
from qosagent.latency.pods import PodTenants, entries
from qosagent.netns import NsRule, ServingNs

MAPPED = bytes(10) + b"\xff\xff"
A, B, C = (MAPPED + bytes([198, 18, n, 1]) for n in (1, 2, 3))
RULES = [NsRule(11, (8000,), process=r"--host 198\.18\.1\.1\b"), NsRule(22, (), process=r"--host 198\.18\.2\.1\b")]


def ns(ino: int, cmd: str, *addrs: bytes) -> ServingNs:
    return ServingNs(ino, ino * 10, frozenset({8000}), (cmd,), frozenset(addrs))


def test_two_pods_on_one_port_are_told_apart_by_their_addresses() -> None:
    found = {1: ns(1, "uvicorn --host 198.18.1.1 --port 8000", A), 2: ns(2, "uvicorn --host 198.18.2.1", B),
             3: ns(3, "nginx", C)}
    want, tenants, shared = entries(found, RULES, [8000, 9000])
    # A tenant's ports, else every watched port (one lookup in the kernel); no rule, no entry.
    assert want == {(A, 8000): 11, (B, 8000): 22, (B, 9000): 22}
    assert tenants == {1: {8000: 11}, 2: {0: 22}} and shared == set()


def test_pods_tenants_by_the_pod_quota_found_in_each_namespace() -> None:
    from qosagent.pods.model import Pod

    found = {1: ns(1, "uvicorn", A), 2: ns(2, "uvicorn", B)}
    rules = [NsRule(33, (), pod_namespace="qa", pod_labels=(("app", "chat"),))]
    chat = Pod("u1", "qa", "chat-0", {"app": "chat"})
    want, tenants, _ = entries(found, rules, [8000], {1: chat}.get)
    assert want == {(A, 8000): 33} and tenants == {1: {0: 33}}  # namespace 2's pod unknown: no pods tenant
    assert entries(found, rules, [8000])[0] == {}  # no pods known at all (quota off): none


def test_an_address_two_serving_namespaces_hold_is_left_out_not_guessed() -> None:
    found = {1: ns(1, "uvicorn --host 198.18.1.1", A, C), 2: ns(2, "uvicorn --host 198.18.2.1", B, C)}
    want, _, shared = entries(found, RULES, [8000])
    assert want == {(A, 8000): 11, (B, 8000): 22} and shared == {C}


class FakeMap:
    """A hash map as ebpf.maps.sync sees one: typed keys and values, by their bytes."""

    class key(ctypes.Structure):  # noqa: N801 - as bcc names a map's types
        _fields_ = [("addr", ctypes.c_uint8 * 16), ("port", ctypes.c_uint16), ("pad", ctypes.c_uint16)]

    class value(ctypes.Structure):  # noqa: N801
        _fields_ = [("tenant", ctypes.c_uint32)]

    def __init__(self) -> None:
        self.d: dict[bytes, bytes] = {}
        self.writes = 0

    def keys(self) -> list:
        return [self.key.from_buffer_copy(k) for k in self.d]

    def lookup(self, k):
        v = self.d.get(bytes(k))
        return None if v is None else self.value.from_buffer_copy(v)

    def update(self, k, v) -> None:
        self.writes += 1
        self.d[bytes(k)] = bytes(v)

    def delete(self, k) -> bool:
        return self.d.pop(bytes(k), None) is not None

    def entries(self) -> dict[tuple[bytes, int], int]:
        return {(k[:16], struct.unpack("=H", k[16:18])[0]): struct.unpack("=I", v)[0] for k, v in self.d.items()}


class FakeConf:
    class value(ctypes.Structure):  # noqa: N801
        _fields_ = [("entries", ctypes.c_uint32)]

    def __init__(self) -> None:
        self.entries = 0

    def update(self, k: int, v) -> None:
        assert k == 0
        self.entries = v.entries


class FakeFollower:
    def __init__(self) -> None:
        self.found: dict[int, ServingNs] = {}
        self.asked = 0

    def current(self, watched, cmdlines: bool, now: float) -> dict[int, ServingNs]:
        self.asked += 1
        assert cmdlines and set(watched) == {8000}
        return self.found


def test_the_map_follows_namespaces_as_they_come_and_go(caplog) -> None:
    caplog.set_level(logging.INFO, "qosagent.latency")
    fol, m, conf = FakeFollower(), FakeMap(), FakeConf()
    pods = PodTenants({"netns.serving": fol}, None, m, conf, lambda: 0.0)  # type: ignore[arg-type]
    names = {11: "alpha", 22: "beta"}
    assert not pods.follow([], [8000], 0.0, names, PodsConfig()) and fol.asked == 0  # no process rule: nothing scanned
    fol.found = {1: ns(1, "uvicorn --host 198.18.1.1", A)}
    assert pods.follow(RULES, [8000], 1.0, names, PodsConfig())
    assert m.entries() == {(A, 8000): 11} and conf.entries == 1
    assert pods.followed == ({"netns": 1, "pid": 10, "addresses": ["198.18.1.1"], "shared": [], "pod": None,
                              "tenants": {"8000": "alpha"}},)
    fol.found[2] = ns(2, "uvicorn --host 198.18.2.1", B)
    assert pods.follow(RULES, [8000], 2.0, names, PodsConfig())
    assert m.entries() == {(A, 8000): 11, (B, 8000): 22} and conf.entries == 2
    writes = m.writes
    # nothing new: nothing written
    assert not pods.follow(RULES, [8000], 3.0, names, PodsConfig()) and m.writes == writes
    del fol.found[1]
    assert pods.follow(RULES, [8000], 4.0, names, PodsConfig())
    assert m.entries() == {(B, 8000): 22} and [n["netns"] for n in pods.followed] == [2]
    assert "network namespace 1 no longer serves here" in caplog.text
    # rules gone: emptied
    assert pods.follow([], [8000], 5.0, names, PodsConfig()) and m.entries() == {} and pods.followed == ()
    assert conf.entries == 0  # and the kernel looks no more


TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 010112C6:1F40 FE0112C6:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
"""


def test_connections_open_in_a_pod_are_listed_from_its_own_proc_entries(tmp_path) -> None:
    from qosagent.hostfs import HostFS

    (tmp_path / "proc" / "net").mkdir(parents=True)
    (tmp_path / "proc" / "net" / "tcp").write_text(TCP.splitlines()[0] + "\n")  # the agent's namespace: none
    (tmp_path / "proc" / "42" / "net").mkdir(parents=True)
    (tmp_path / "proc" / "42" / "net" / "tcp").write_text(TCP)
    fs = HostFS(tmp_path)
    assert adopt.established(fs, [8000]) == []
    (c,) = adopt.established(fs, [8000], elsewhere=[42, 43])  # 43: gone meanwhile, nothing read
    assert (c.local, c.lport, c.remote, c.rport) == (A, 8000, MAPPED + bytes([198, 18, 1, 254]), 0xD431)


def test_more_entries_than_the_map_holds_are_cut_with_a_warning_not_a_failed_write(caplog, monkeypatch) -> None:
    from qosagent.latency import pods as pods_mod

    monkeypatch.setattr(pods_mod, "MAX_ENTRIES", 2)
    fol, m, conf = FakeFollower(), FakeMap(), FakeConf()
    fol.found = {1: ns(1, "uvicorn --host 198.18.1.1", A), 2: ns(2, "uvicorn --host 198.18.2.1", B, C)}
    pods = PodTenants({"netns.serving": fol}, None, m, conf, lambda: 0.0)  # type: ignore[arg-type]
    assert pods.follow(RULES, [8000], 1.0, {}, PodsConfig())
    assert len(m.entries()) == 2 and conf.entries == 2
    assert "3 (address, port) entries for process and pods tenants, room for 2" in caplog.text
    caplog.clear()
    pods.follow(RULES, [8000], 2.0, {}, PodsConfig())
    assert "room for" not in caplog.text  # said once, not every second
