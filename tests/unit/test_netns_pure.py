"""Serving network namespaces, the pure parts: a namespace's own addresses from /proc/PID/net, which process rules
a namespace's processes or its pod match, the one scan every capability shares, and what the config accepts for
match.process and match.pods (its listening ports are tests/unit/test_listeners.py's)."""

from __future__ import annotations

import pytest

from qosagent import config
from qosagent.netns import (
    NsRule,
    ServingNs,
    fib_local_v4,
    if_inet6,
    namespace_tenants,
    ns_rules,
)
from qosagent.pods.model import Pod
from qosagent.tenants import tenant_entries

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0
   2: 0101A8C6:1F40 0201A8C6:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000000000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:0 0
"""


def test_process_rules_first_match_wins_a_port() -> None:
    ns = ServingNs(1, 10, frozenset({8000}), ("python -m vllm serve --served-model-name llama", "sleep 1"))
    rules = [NsRule(7, (8000,), r"--served-model-name llama\b"), NsRule(8, (), r"vllm"), NsRule(9, (), r"nomatch")]
    assert namespace_tenants(rules, ns, None) == {8000: 7, 0: 8}
    assert namespace_tenants([NsRule(9, (), r"nomatch")], ns, None) == {}


def test_pods_and_process_rules_feed_one_resolution_in_config_order() -> None:
    c = cfg({"name": "chat", "tier": "gold", "match": {"pods": {"namespace": "ml", "labels": {"app": "vllm"}},
                                                        "ports": [8000]}},
            {"name": "batch", "tier": "bronze", "match": {"process": "vllm"}},
            {"name": "rest", "tier": "silver", "match": {"pods": {"labels": {"team": "x"}}}})
    rules = ns_rules(c.tenants)
    assert [r.by_pod for r in rules] == [True, False, True]
    ns = ServingNs(1, 10, frozenset({8000}), ("python -m vllm serve",))
    chat, batch, rest = (rules[i].tenant for i in range(3))
    pod = Pod("u1", "ml", "vllm-0", {"app": "vllm", "team": "x", "extra": "y"})
    assert namespace_tenants(rules, ns, pod) == {8000: chat, 0: batch}
    # Labels must all be equal, the namespace exactly; an unknown pod matches no pods rule.
    assert namespace_tenants(rules, ns, Pod("u1", "ml-dev", "v", {"app": "vllm", "team": "x"})) == {0: batch}
    assert namespace_tenants(rules[2:], ns, Pod("u1", "a", "v", {"team": "x"})) == {0: rest}
    assert namespace_tenants(rules[2:], ns, Pod("u1", "a", "v", {"team": "y"})) == {}
    assert namespace_tenants([rules[0], rules[2]], ns, None) == {}
    assert tenant_entries(c) == ({}, [])  # per namespace: nothing in the maps every namespace shares


def cfg(*tenants: dict) -> config.Config:
    return config.parse({"quota": {"enabled": True}, "tenants": list(tenants)}, "test")


def test_a_process_tenants_ports_are_not_claimed_everywhere() -> None:
    c = cfg({"name": "a", "tier": "gold", "match": {"process": "llama", "ports": [8000]}},
            {"name": "b", "tier": "gold", "match": {"process": "mistral", "ports": [8000]}})
    assert tenant_entries(c) == ({}, [])
    assert 8000 in c.watched_ports()


@pytest.mark.parametrize(("match", "why"), [
    ({"pods": {}}, "match.pods: expected namespace, labels or both"),
    ({"pods": {"namespace": "ML"}}, "match.pods.namespace: String should match"),
    ({"pods": {"labels": {"app": "a b"}}}, "match.pods.labels.app: String should match"),
    ({"pods": {"namespace": "ml"}, "cidrs": ["10.0.0.0/8"]}, "match.pods: cannot be combined"),
    ({"pods": {"namespace": "ml"}, "process": "x"}, "match.pods: cannot be combined"),
    ({"process": "("}, "match.process: not a regular expression"),
    ({"process": "x", "cidrs": ["10.0.0.0/8"]}, "match.process: cannot be combined"),
])
def test_refused_matches_say_why(match: dict, why: str) -> None:
    with pytest.raises(config.ConfigError, match=why.replace("(", r"\(")):
        cfg({"name": "a", "tier": "gold", "match": match})


@pytest.mark.parametrize("match", [{"process": "x"}, {"pods": {"namespace": "ml"}}])
def test_a_per_namespace_tenant_cannot_share_a_port_claimed_everywhere(match: dict) -> None:
    with pytest.raises(config.ConfigError, match=r"tenants\[1\].match.ports: port 8000 is claimed by 'a'"):
        cfg({"name": "a", "tier": "gold", "match": {"ports": [8000]}},
            {"name": "b", "tier": "gold", "match": {**match, "ports": [8000]}})


def test_namespaces_by_inode_and_their_listeners_read_again_only_when_due(tmp_path) -> None:
    from qosagent.hostfs import HostFS
    from qosagent.netns import RECHECK_IDLE, ListenCache, serving_namespaces

    def proc(pid: int, ns: str, tcp: str, cmd: str) -> None:
        fake_proc(tmp_path, pid, ns, tcp, cmd)

    header = TCP.splitlines()[0] + "\n"
    proc(1, "host", TCP, "init")
    proc(10, "a", TCP, "vllm serve --served-model-name llama")
    proc(11, "a", TCP, "sleep infinity")
    proc(20, "b", header, "vllm serve --served-model-name mistral")
    fs = HostFS(tmp_path)
    own = (tmp_path / "ns" / "host").stat().st_ino
    cache = ListenCache()
    found = serving_namespaces(fs, [8000], own, True, cache, now=100.0)
    (a,) = found.values()
    assert a.ino == (tmp_path / "ns" / "a").stat().st_ino and a.ports == {8000}
    assert sorted(a.cmdlines) == ["sleep infinity", "vllm serve --served-model-name llama"]
    # b starts listening: seen once its idle recheck is due, not before.
    (tmp_path / "proc" / "20" / "net" / "tcp").write_text(TCP)
    assert len(serving_namespaces(fs, [8000], own, False, cache, now=100.0 + RECHECK_IDLE / 2)) == 1
    assert len(serving_namespaces(fs, [8000], own, False, cache, now=100.0 + RECHECK_IDLE)) == 2
    # Gone processes take their namespace out of the cache.
    for f in (tmp_path / "proc" / "20").rglob("*"):
        if f.is_file() or f.is_symlink():
            f.unlink()
    assert len(serving_namespaces(fs, [8000], own, False, cache, now=200.0)) == 1
    assert (tmp_path / "ns" / "b").stat().st_ino not in cache.read


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        |-- 127.0.0.1
           /32 host LOCAL
     +-- 169.254.0.0/16 2 0 2
        |-- 169.254.1.1
           /32 host LOCAL
     +-- 198.18.1.0/24 2 0 2
        |-- 198.18.1.0
           /24 link UNICAST
        |-- 198.18.1.1
           /32 host LOCAL
        |-- 198.18.1.255
           /32 link BROADCAST
Local:
  +-- 0.0.0.0/0 3 0 5
     +-- 127.0.0.0/8 2 0 2
        |-- 127.0.0.1
           /32 host LOCAL
     +-- 198.18.1.0/24 2 0 2
        |-- 198.18.1.1
           /32 host LOCAL
"""
IF_INET6 = """00000000000000000000000000000001 01 80 10 80       lo
20010db8000000000000000000000001 02 40 00 80     eth0
fe80000000000000a8bbccfffe000001 02 40 20 80     eth0
"""
MAPPED = bytes(10) + b"\xff\xff"


def test_a_namespaces_own_addresses_are_its_local_routes_and_interface_addresses_not_loopback_nor_link_local() -> None:
    assert fib_local_v4(FIB_TRIE.splitlines()) == {MAPPED + bytes([198, 18, 1, 1])}
    assert if_inet6(IF_INET6.splitlines()) == {bytes.fromhex("20010db8000000000000000000000001")}
    assert fib_local_v4(["garbage", "|-- not.an.address", "/32 host LOCAL"]) == set()


def fake_proc(root, pid: int, ns: str, tcp: str, cmd: str) -> None:
    """A process in /proc under root: its namespace (one inode per name), its socket table, addresses, command line."""
    d = root / "proc" / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "net").mkdir()
    target = root / "ns" / ns
    target.parent.mkdir(exist_ok=True)
    if not target.exists():
        target.write_text("")
    # One inode per namespace, named as the kernel's link names it (namespaces(7)): "net:[INODE]".
    (d / "ns" / "net").symlink_to(f"net:[{target.stat().st_ino}]")
    (d / "net" / "tcp").write_text(tcp)
    (d / "net" / "fib_trie").write_text(FIB_TRIE.replace("198.18.1.", f"198.18.{pid}."))
    (d / "cmdline").write_text(cmd.replace(" ", "\0"))


def test_one_scan_serves_every_capability_that_asks_within_a_period(tmp_path, monkeypatch) -> None:
    from qosagent import netns
    from qosagent.hostfs import HostFS
    from qosagent.services import shared

    fake_proc(tmp_path, 1, "host", TCP, "init")
    fake_proc(tmp_path, 10, "a", TCP, "vllm serve --served-model-name llama")
    scans = []
    real = netns.serving_namespaces
    monkeypatch.setattr(netns, "serving_namespaces", lambda *a, **k: scans.append(a) or real(*a, **k))
    services: dict = {}
    f = shared(services, netns.Follower, HostFS(tmp_path), lambda: 0.0)
    f.own = (tmp_path / "ns" / "host").stat().st_ino
    assert shared(services, netns.Follower, HostFS(tmp_path), lambda: 0.0) is f
    (a,) = f.current([8000], True, now=10.0).values()
    assert a.addrs == {MAPPED + bytes([198, 18, 10, 1])} and a.cmdlines == ("vllm serve --served-model-name llama",)
    fake_proc(tmp_path, 20, "b", TCP, "vllm serve --served-model-name mistral")
    assert len(f.current([8000], True, now=10.5)) == 1  # quota's ask and latency's in one period: one scan
    assert len(scans) == 1
    assert len(f.current([8000], True, now=11.0)) == 2  # the period passed: the new namespace is found
    assert len(f.current([8000, 9000], True, now=11.1)) == 2 and len(scans) == 3  # other ports: scanned afresh
    # ... and every namespace's listeners read again, however recently (a port it listens on since shows).
    (tmp_path / "proc" / "10" / "net" / "tcp").write_text(TCP.replace("0100007F:1F90", "0100007F:2328"))
    assert f.current([8000, 9000], True, now=11.2)[a.ino].ports == {8000}  # the same ports asked: as scanned
    assert f.current([8000, 9000, 9001], True, now=11.3)[a.ino].ports == {8000, 9000}


def test_a_namespace_is_named_by_the_process_that_answered(tmp_path, monkeypatch) -> None:
    from qosagent import netns
    from qosagent.hostfs import HostFS

    fake_proc(tmp_path, 1, "host", TCP, "init")
    fake_proc(tmp_path, 10, "a", TCP, "sleep 1")
    fake_proc(tmp_path, 11, "a", TCP, "vllm serve")
    for f in ("tcp", "fib_trie"):  # pid 10 exits between the listing of /proc and the reading of its sockets
        (tmp_path / "proc" / "10" / "net" / f).unlink()
    listdir = netns.os.listdir
    monkeypatch.setattr(netns.os, "listdir", lambda p: sorted(listdir(p)))  # /proc lists pids in order
    (a,) = netns.serving_namespaces(HostFS(tmp_path), [8000], (tmp_path / "ns" / "host").stat().st_ino,
                                    False).values()
    assert a.pid == 11 and a.pids == (10, 11) and a.addrs, a
