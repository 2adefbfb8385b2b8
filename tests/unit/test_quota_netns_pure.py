"""Serving network namespaces, the pure parts: listening ports from /proc/net/tcp text, which process rules a
namespace's processes match, and what the config accepts for match.process and match.pods."""

from __future__ import annotations

import pytest

from qosagent import config
from qosagent.quota.netns import ServingNs, listening_ports, process_tenants
from qosagent.tenants import tenant_entries

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0
   2: 0101A8C6:1F40 0201A8C6:D431 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
"""
TCP6 = """  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000000000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:0 0
"""


def test_listening_ports_are_the_listen_rows_only() -> None:
    assert listening_ports(TCP.splitlines()) == {8000, 8080}  # the established socket on 8000 is not a listener
    assert listening_ports(TCP6.splitlines()) == {3000}
    assert listening_ports(["header only"]) == set()


def test_the_first_row_of_another_state_ends_the_listeners() -> None:
    def rows():
        yield from TCP.splitlines()
        raise AssertionError("read past the listeners")

    assert listening_ports(rows()) == {8000, 8080}


def test_process_rules_first_match_wins_a_port() -> None:
    ns = ServingNs(1, 10, frozenset({8000}), ("python -m vllm serve --served-model-name llama", "sleep 1"))
    rules = [(r"--served-model-name llama\b", (8000,), 7), (r"vllm", (), 8), (r"nomatch", (), 9)]
    assert process_tenants(rules, ns) == {8000: 7, 0: 8}
    assert process_tenants([(r"nomatch", (), 9)], ns) == {}


def cfg(*tenants: dict) -> config.Config:
    return config.parse({"tenants": list(tenants)}, "test")


def test_a_process_tenants_ports_are_not_claimed_everywhere() -> None:
    c = cfg({"name": "a", "tier": "gold", "match": {"process": "llama", "ports": [8000]}},
            {"name": "b", "tier": "gold", "match": {"process": "mistral", "ports": [8000]}})
    assert tenant_entries(c) == ({}, [])
    assert 8000 in c.watched_ports()


@pytest.mark.parametrize(("match", "why"), [
    ({"pods": {"namespace": "ml", "labels": {"app": "vllm"}}}, "match.pods: matching by pod"),
    ({"process": "("}, "match.process: not a regular expression"),
    ({"process": "x", "cidrs": ["10.0.0.0/8"]}, "match.process: cannot be combined"),
])
def test_refused_matches_say_why(match: dict, why: str) -> None:
    with pytest.raises(config.ConfigError, match=why.replace("(", r"\(")):
        cfg({"name": "a", "tier": "gold", "match": match})


def test_a_process_tenant_cannot_share_a_port_claimed_everywhere() -> None:
    with pytest.raises(config.ConfigError, match=r"tenants\[1\].match.ports: port 8000 is claimed by 'a'"):
        cfg({"name": "a", "tier": "gold", "match": {"ports": [8000]}},
            {"name": "b", "tier": "gold", "match": {"process": "x", "ports": [8000]}})


def test_namespaces_by_inode_and_their_listeners_read_again_only_when_due(tmp_path) -> None:
    from qosagent.hostfs import HostFS
    from qosagent.quota.netns import RECHECK_IDLE, ListenCache, serving_namespaces

    def proc(pid: int, ns: str, tcp: str, cmd: str) -> None:
        d = tmp_path / "proc" / str(pid)
        (d / "ns").mkdir(parents=True)
        (d / "net").mkdir()
        target = tmp_path / "ns" / ns
        target.parent.mkdir(exist_ok=True)
        if not target.exists():
            target.write_text("")
        (d / "ns" / "net").hardlink_to(target)  # one inode per namespace, as nsfs gives
        (d / "net" / "tcp").write_text(tcp)
        (d / "cmdline").write_text(cmd.replace(" ", "\0"))

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
        if f.is_file():
            f.unlink()
    assert len(serving_namespaces(fs, [8000], own, False, cache, now=200.0)) == 1
    assert (tmp_path / "ns" / "b").stat().st_ino not in cache.read
