"""Odd packets through the real classifier with BPF_PROG_TEST_RUN: no crash, the right verdict, counted."""

from __future__ import annotations

import os
import uuid

import pytest

from qosagent.config import parse
from qosagent.ebpf import maps
from qosagent.ebpf.tenant_ports import read_claims
from qosagent.quota import datapath as dp
from qosagent.quota.rules import baseline_buckets
from qosagent.quota.layout import TC_ACT_SHOT, TC_ACT_UNSPEC
from qosagent.tenants import FLEET_NO_END, UNMATCHED_ID, tenant_id
from testkit.quota_packets import ACK, SYN, counts, eth, ipv4, ipv6, loaded, request, run, scratch_pin_root, tcp

pytestmark = pytest.mark.privileged

C4, S4 = "10.1.2.3", "10.9.0.1"
C6, S6 = "2001:db8::7", "2001:db8:ffff::1"


def config(pin_root: str, portco_ports: tuple[int, ...] = (8100,), watched: tuple[int, ...] = (8000,)):
    return parse({
        "bpf": {"pin_root": pin_root},
        "latency": {"ports": list(watched)},
        "quota": {"enabled": True},
        "tenants": [
            {"name": "portco", "tier": "gold", "match": {"ports": list(portco_ports)},
             "quota": {"rps": 1, "burst": 1, "connections_per_s": 1}},
            {"name": "cidrco", "tier": "silver", "match": {"cidrs": ["10.1.0.0/16", "2001:db8::/48"]},
             "quota": {"rps": 1000, "burst": 1000, "connections_per_s": 1}},
            {"name": "hdrco", "tier": "bronze", "match": {"header": {"name": "X-Tenant-ID", "value": "acme"}},
             "quota": {"rps": 1000, "burst": 1000}},
        ],
    }, "test")


@pytest.fixture
def pin_root(bpf):
    with scratch_pin_root() as root:
        yield root


@pytest.fixture
def prog(pin_root):
    with loaded(config(pin_root)) as d:
        yield d


def test_truncated_headers_pass_and_are_counted(prog):
    # The kernel refuses to test-run an IP frame shorter than its IP header; a non-IP frame of 14 bytes runs.
    with pytest.raises(OSError):
        run(prog, ipv4(C4, S4, b"")[:14 + 12])
    assert run(prog, eth(0x88B5)) == TC_ACT_UNSPEC
    syn = tcp(40000, 8100, SYN)
    long_ihl = bytearray(ipv4(C4, S4, syn))
    long_ihl[14] = 0x4F  # a 60-byte IP header (options) in a frame that ends before the options do
    assert run(prog, bytes(long_ihl)[:14 + 20 + 20]) == TC_ACT_UNSPEC
    assert run(prog, ipv4(C4, S4, syn)[:14 + 20 + 10]) == TC_ACT_UNSPEC  # TCP header cut
    assert run(prog, ipv6(C6, S6, syn, ext=[(0, b"\x01\x04\0\0\0\0")])[:14 + 40 + 4]) == TC_ACT_UNSPEC
    # The IP length claims more than the frame holds.
    assert run(prog, ipv4(C4, S4, tcp(40000, 8100, payload=request()), tot_len=1400)) == TC_ACT_UNSPEC
    assert prog.read().stats["malformed"] == 4
    assert counts(prog, "portco") == (0, 0, 0, 0)


def test_ip_options_and_quota_verdicts(prog):
    opts = b"\x01" * 8  # NOPs: the TCP header starts 8 bytes later
    frame = ipv4(C4, S4, tcp(40000, 8100, payload=request()), options=opts)
    assert run(prog, frame) == TC_ACT_UNSPEC  # the one token
    assert run(prog, frame) == TC_ACT_SHOT  # over quota: dropped, TCP retransmits
    # Segments that are not request starts are never dropped, over quota or not.
    assert run(prog, ipv4(C4, S4, tcp(40000, 8100, payload=b"body of the request " * 10), options=opts)) \
        == TC_ACT_UNSPEC
    assert run(prog, ipv4(C4, S4, tcp(40000, 8100, ACK), options=opts)) == TC_ACT_UNSPEC  # empty payload
    assert counts(prog, "portco") == (1, 1, 0, 0)
    # New connections to the port: portco's connection bucket (1/s, burst 1).
    assert run(prog, ipv4(C4, S4, tcp(40001, 8100, SYN), options=opts)) == TC_ACT_UNSPEC
    assert run(prog, ipv4(C4, S4, tcp(40002, 8100, SYN), options=opts)) == TC_ACT_SHOT
    assert counts(prog, "portco") == (1, 1, 1, 1)
    # The port claims its connections (before cidrco's 10.1.0.0/16, which the client is in) straight from
    # tenant_ports: nothing is cached for them.
    assert prog.flows() == {}


def test_ipv6_extension_headers_and_cidr(prog):
    ext = [(0, b"\x01\x04\0\0\0\0"), (60, b"\x01\x04\0\0\0\0")]  # hop-by-hop, destination options
    assert run(prog, ipv6(C6, S6, tcp(40001, 8000, payload=request(method="POST")), ext=ext)) == TC_ACT_UNSPEC
    assert counts(prog, "cidrco")[:2] == (1, 0)
    assert prog.flows() == {(C6, 40001, S6, 8000): (tenant_id("cidrco"), "cidr")}  # an unclaimed port: cached
    # Connections: 1/s with a burst of 1, from v4 and v6 alike (one tenant, one bucket).
    assert run(prog, ipv4(C4, S4, tcp(40002, 8000, SYN))) == TC_ACT_UNSPEC
    assert run(prog, ipv6(C6, S6, tcp(40003, 8000, SYN), ext=ext)) == TC_ACT_SHOT
    assert counts(prog, "cidrco")[2:] == (1, 1)
    # Unknown next header after the extension headers (no TCP): passed silently.
    assert run(prog, ipv6(C6, S6, b"\0" * 8, ext=ext, proto=17)) == TC_ACT_UNSPEC


METHODS = ("GET", "PUT", "POST", "HEAD", "PATCH", "TRACE", "DELETE", "OPTIONS", "CONNECT")


def test_every_method_takes_a_token_and_near_misses_do_not(prog):
    for i, method in enumerate(METHODS):
        assert run(prog, ipv4(C4, S4, tcp(41000 + i, 8000, payload=request(method=method)))) == TC_ACT_UNSPEC
    assert counts(prog, "cidrco")[:2] == (len(METHODS), 0)
    # A method's letters without the space, one more letter, or lower case: a body segment, passed uncounted.
    for i, line in enumerate(("GETS", "PUTS", "POSTS", "HEADS", "PATCHY", "TRACED", "DELETED", "OPTIONSX",
                              "CONNECTS", "get", "POST\t", "DELET")):
        payload = f"{line} / HTTP/1.1\r\nHost: server\r\n\r\n".encode()
        assert run(prog, ipv4(C4, S4, tcp(42000 + i, 8000, payload=payload))) == TC_ACT_UNSPEC
    assert counts(prog, "cidrco")[:2] == (len(METHODS), 0)


def test_fragments_pass_and_are_counted(prog):
    more = 0x2000
    assert run(prog, ipv4(C4, S4, tcp(40000, 8100, payload=request()), frag=more)) == TC_ACT_UNSPEC
    assert run(prog, ipv4(C4, S4, b"x" * 64, frag=185)) == TC_ACT_UNSPEC  # a later fragment: no TCP header
    frag6 = [(44, b"\x00\x08\0\0\0\x01")]  # offset 1 (x 8 bytes)
    assert run(prog, ipv6(C6, S6, b"x" * 64, ext=frag6)) == TC_ACT_UNSPEC
    atomic6 = [(44, b"\0\0\0\0\0\x02")]  # offset 0, no more fragments: a whole packet, classified
    assert run(prog, ipv6(C6, S6, tcp(40004, 8000, payload=request()), ext=atomic6)) == TC_ACT_UNSPEC
    st = prog.read().stats
    assert st["fragment"] == 3
    assert counts(prog, "portco") == (0, 0, 0, 0)
    assert counts(prog, "cidrco")[0] == 1


def test_a_tick_at_rest_asks_the_kernel_nothing_and_sees_the_next_count(prog, monkeypatch):
    """The classifier bumps its CPU's stats generation after each count by reason: the tick's read makes no
    BPF_MAP_LOOKUP_BATCH while none moved, and shows a malformed packet or an unmatched connection at the next read."""

    calls = []
    lookup_batch = maps._lookup_batch
    monkeypatch.setattr(maps, "_lookup_batch", lambda *a: calls.append(a) or lookup_batch(*a))
    for _ in range(3):  # every slot and every CPU's stats at the first read, once more at the second
        prog.read_changed()
    calls.clear()
    rest = [prog.read_changed() for _ in range(5)]
    assert calls == [] and all(r.stats is rest[0].stats for r in rest)
    assert run(prog, ipv4(C4, S4, tcp(40000, 8100, payload=request()), tot_len=1400)) == TC_ACT_UNSPEC
    assert prog.read_changed().stats["malformed"] == 1 and calls
    prog.read_changed()  # once more, the tick after
    calls.clear()
    assert [prog.read_changed().stats["malformed"] for _ in range(3)] == [1] * 3 and calls == []
    assert run(prog, ipv4("10.7.0.1", S4, tcp(40000, 8000, SYN))) == TC_ACT_UNSPEC  # watched, no tenant's
    assert prog.read_changed().stats["unmatched"] == 1


def test_header_match_and_header_split_across_segments(prog):
    cut = request(headers={"User-Agent": "t", "X-Tenant-ID": "acme"})
    first = cut[:cut.index(b"X-Ten") + 5]
    # The header continues in a later segment: the request is unmatched (passed) and counted as incomplete.
    assert run(prog, ipv4("10.200.0.1", S4, tcp(41000, 8000, payload=first))) == TC_ACT_UNSPEC
    assert run(prog, ipv4("10.200.0.1", S4, tcp(41000, 8000, payload=cut[len(first):]))) == TC_ACT_UNSPEC
    r = prog.read()
    assert r.stats["header_incomplete"] == 1
    assert r.counts[UNMATCHED_ID][0] == 1
    assert counts(prog, "hdrco") == (0, 0, 0, 0)
    # The next request on the connection carries it whole; the name matches in any case.
    whole = request(headers={"x-tenant-id": "acme"})
    assert run(prog, ipv4("10.200.0.1", S4, tcp(41000, 8000, payload=whole))) == TC_ACT_UNSPEC
    assert counts(prog, "hdrco")[0] == 1
    assert prog.flows()[("10.200.0.1", 41000, S4, 8000)] == (tenant_id("hdrco"), "header")
    # Another value, or the header only in the body (after the blank line), is not a match.
    assert run(prog, ipv4("10.200.0.2", S4, tcp(41001, 8000, payload=request(headers={"X-Tenant-ID": "acm"})))) \
        == TC_ACT_UNSPEC
    body = request() + b"X-Tenant-ID: acme\r\n"
    assert run(prog, ipv4("10.200.0.3", S4, tcp(41002, 8000, payload=body))) == TC_ACT_UNSPEC
    assert counts(prog, "hdrco")[0] == 1
    assert prog.read().counts[UNMATCHED_ID][0] == 3


def test_unwatched_port_and_non_tcp_pass_uncounted(prog):
    assert run(prog, ipv4(C4, S4, tcp(40000, 9999, payload=request()))) == TC_ACT_UNSPEC
    assert run(prog, ipv4(C4, S4, b"\0" * 16, proto=17)) == TC_ACT_UNSPEC
    r = prog.read()
    assert sum(r.stats.values()) == 0
    assert all(c == (0, 0, 0, 0) for c in r.counts.values())


def test_override_holds_while_the_heartbeat_is_fresh_then_baseline(prog):
    from qosagent.quota.layout import QuotaConf
    from qosagent.quota.rules import bucket

    tid = tenant_id("cidrco")  # baseline 1000/s
    prog.set_overrides({tid: bucket(0, 0)})  # shed
    prog.heartbeat()
    frame = ipv4(C4, S4, tcp(40010, 8000, payload=request()))
    assert run(prog, frame) == TC_ACT_SHOT
    # The agent stops ticking: once the heartbeat is older than the timeout, the baseline applies again.
    t = prog.maps["quota_config"]
    conf = QuotaConf.from_buffer_copy(bytes(t.lookup(0)))
    conf.heartbeat_ns -= int(prog.cfg.quota.heartbeat_timeout * 1e9) + 1
    t.update(0, bytes(conf))
    assert run(prog, frame) == TC_ACT_UNSPEC
    assert prog.read().stats["override_expired"] == 1
    assert counts(prog, "cidrco")[:2] == (1, 1)


def test_a_fleet_share_holds_where_lowest_until_its_lease_or_the_heartbeat_ends(prog):
    import time

    from qosagent.quota.layout import QuotaConf
    from qosagent.quota.rules import bucket

    tid = tenant_id("cidrco")  # baseline 1000/s, burst 1000
    prog.heartbeat()
    far = time.monotonic_ns() + 60 * 10**9
    frame = ipv4(C4, S4, tcp(40020, 8000, payload=request()))
    # A share above the baseline changes nothing: the lowest holds.
    prog.set_fleet({tid: (bucket(5000, 5000), far)})
    assert [run(prog, frame) for _ in range(3)] == [TC_ACT_UNSPEC] * 3
    # A share of one request per ten seconds, burst 2 (the bucket's state is shared with the baseline's, which
    # just admitted three): one more goes, then drops.
    prog.set_fleet({tid: (bucket(0.1, 2), far)})
    assert [run(prog, frame) for _ in range(3)] == [TC_ACT_UNSPEC, TC_ACT_SHOT, TC_ACT_SHOT]
    # With admission's override too: still the lowest of the three (the share).
    prog.set_overrides({tid: bucket(500, 500)})
    assert run(prog, frame) == TC_ACT_SHOT
    # Its lease ended (written in the past): the others decide again, counted. (The bucket is emptied first: GCRA
    # keeps one arrival time per tenant, which the slow share pushed 20 s ahead; a switch never grants a burst.)
    fresh_bucket = lambda: prog.maps["quota_buckets"].zero(prog.slots[tid])  # noqa: E731
    fresh_bucket()
    prog.set_fleet({tid: (bucket(0.1, 1), time.monotonic_ns() - 1)})
    assert run(prog, frame) == TC_ACT_UNSPEC
    assert prog.read().stats["fleet_expired"] == 1
    # A share without an end (the safe share) ends with the heartbeat all the same.
    prog.set_overrides({})
    prog.set_fleet({tid: (bucket(0.001, 1), FLEET_NO_END)})
    assert run(prog, frame) == TC_ACT_SHOT
    t = prog.maps["quota_config"]
    conf = QuotaConf.from_buffer_copy(bytes(t.lookup(0)))
    conf.heartbeat_ns -= int(prog.cfg.quota.heartbeat_timeout * 1e9) + 1
    t.update(0, bytes(conf))
    fresh_bucket()
    assert run(prog, frame) == TC_ACT_UNSPEC
    assert prog.read().stats["fleet_expired"] == 2


def claims(d) -> dict[int, tuple[int, int]]:
    return read_claims(d.maps["tenant_ports"].fd)


def test_a_reload_moves_a_port_claim_and_zeroes_the_old_port(prog):
    tid = tenant_id("portco")
    slot = prog.slots[tid]
    assert slot > 0 and claims(prog) == {8100: (tid, slot)}
    # portco moves to 8200; 8100 stays watched, so its traffic goes on to the client-address rules.
    cfg = config(prog.cfg.bpf.pin_root, portco_ports=(8200,), watched=(8000, 8100))
    prog.write_config(cfg, baseline_buckets(cfg))
    assert claims(prog) == {8200: (tid, slot)}  # the slot stays with the tenant
    for port in (40000, 40001):  # still claimed, the second would be over portco's 1/s
        assert run(prog, ipv4(C4, S4, tcp(port, 8100, payload=request()))) == TC_ACT_UNSPEC
    assert counts(prog, "cidrco")[:2] == (2, 0)
    assert prog.flows()[(C4, 40000, S4, 8100)] == (tenant_id("cidrco"), "cidr")
    assert run(prog, ipv4(C4, S4, tcp(40002, 8200, payload=request()))) == TC_ACT_UNSPEC
    assert run(prog, ipv4(C4, S4, tcp(40002, 8200, payload=request()))) == TC_ACT_SHOT
    assert counts(prog, "portco") == (1, 1, 0, 0)


def test_a_restarted_agent_adopts_the_port_claims_and_zeroes_the_ones_it_drops(pin_root):
    tid = tenant_id("portco")
    frame = ipv4(C4, S4, tcp(40000, 8100, payload=request()))
    cfg = config(pin_root)
    first = dp.Datapath(cfg)
    first.write_config(cfg, baseline_buckets(cfg))
    slot = first.slots[tid]
    assert run(first, frame) == TC_ACT_UNSPEC  # the one token
    first.close()  # the agent dies; the pins stay

    moved = config(pin_root, portco_ports=(8200,))
    d = dp.Datapath(moved)
    try:
        assert d.adopted
        assert d.ports.written == {8100: (tid, slot)}  # read back from the pinned array
        run(d, frame)  # still portco's until the new config is written (the verdict depends on the time since)
        d.write_config(moved, baseline_buckets(moved))
        assert claims(d) == {8200: (tid, slot)}
        assert run(d, frame) == TC_ACT_UNSPEC  # 8100: claimed by no one and not watched
        assert run(d, ipv4(C4, S4, tcp(40001, 8200, payload=request()))) in (TC_ACT_UNSPEC, TC_ACT_SHOT)
        admitted, dropped, _, _ = counts(d, "portco")
        assert admitted + dropped == 3  # the same slot throughout: counters continue
    finally:
        d.close()


def test_a_program_that_fails_to_load_leaves_no_pins(bpf, tmp_path, monkeypatch):
    import shutil as sh

    from qosagent.ebpf.loader import BpfError, bpf_dir

    broken = tmp_path / "bpf"
    sh.copytree(bpf_dir(), broken)
    (broken / "quota.c").write_text((broken / "quota.c").read_text() + "\nint quota_broken(struct __sk_buff *skb) {")
    monkeypatch.setenv("QOSAGENT_BPF_DIR", str(broken))
    cfg = config(f"/sys/fs/bpf/qosagent-test-{uuid.uuid4().hex[:8]}")
    with pytest.raises(BpfError):
        dp.Datapath(cfg)
    assert not os.path.exists(cfg.bpf.pin_root)
