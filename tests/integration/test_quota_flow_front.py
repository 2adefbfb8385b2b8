"""The classifier's per-CPU flow front (quota_flow_l1 in bpf/quota.c) through BPF_PROG_TEST_RUN: a request start
it answers is charged exactly as one the LRU answers, a rule change invalidates it (quota_config.rules_gen), a
header claim lands in it, and a SYN reusing a 4-tuple clears it."""

from __future__ import annotations

import os

import pytest

from qosagent.config import parse
from qosagent.quota import datapath as dp
from qosagent.quota.rules import baseline_buckets
from qosagent.quota.layout import TC_ACT_SHOT, TC_ACT_UNSPEC, FlowKey, QuotaConf
from qosagent.tenants import UNMATCHED_ID, tenant_id
from testkit.quota_packets import SYN, counts, ipv4, loaded, request, run, scratch_pin_root, tcp

pytestmark = pytest.mark.privileged

S4 = "10.9.0.1"
NEAR, FAR = "10.1.0.0/16", "10.2.0.0/16"


def config(pin_root: str, cidrco: str = NEAR, otherco: str = FAR):
    q = {"rps": 1, "burst": 2}
    return parse({
        "bpf": {"pin_root": pin_root},
        "latency": {"ports": [8000]},
        "quota": {"enabled": True},
        "tenants": [
            {"name": "cidrco", "tier": "gold", "match": {"cidrs": [cidrco]}, "quota": q},
            {"name": "otherco", "tier": "gold", "match": {"cidrs": [otherco]}, "quota": q},
            {"name": "hdrco", "tier": "gold", "match": {"header": {"name": "X-Tenant-ID", "value": "acme"}},
             "quota": q},
        ],
    }, "test")


@pytest.fixture
def one_cpu():
    """The front is per CPU: every test run of a test on one CPU, so that a packet meets what the last one left."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture
def prog(bpf, one_cpu):
    with scratch_pin_root() as root, loaded(config(root)) as d:
        yield d


def rules_gen(d) -> int:
    return QuotaConf.from_buffer_copy(bytes(d.maps["quota_config"].lookup(0))).rules_gen


def front(d, cpu: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(client port, local port) -> (tenant, gen) of the live entries in one CPU's front."""
    out = {}
    for _k, v in d.program.map("quota_flow_l1").items():
        e = v[cpu]
        if e.tenant:
            k = FlowKey.from_buffer_copy(bytes(e.flow_w))
            out[(k.rport, k.lport)] = (e.tenant, e.gen)
    return out


def req(client: str, port: int, headers: dict[str, str] | None = None) -> bytes:
    return ipv4(client, S4, tcp(port, 8000, payload=request(headers=headers)))


def test_a_cidr_flow_answered_by_the_front_is_charged_as_before(prog, one_cpu):
    frame = req("10.1.2.3", 40000)
    assert run(prog, frame) == TC_ACT_UNSPEC  # resolved by address, then cached in both
    assert front(prog, one_cpu) == {(40000, 8000): (tenant_id("cidrco"), rules_gen(prog))}
    assert run(prog, frame) == TC_ACT_UNSPEC  # the second token of the burst, from the front
    assert run(prog, frame) == TC_ACT_SHOT  # the bucket is dry
    assert counts(prog, "cidrco") == (2, 1, 0, 0)
    assert prog.flows() == {("10.1.2.3", 40000, S4, 8000): (tenant_id("cidrco"), "cidr")}  # still the record


def test_a_reload_that_moves_the_cidr_charges_the_new_tenant(prog, one_cpu):
    frame = req("10.1.2.3", 40000)
    assert run(prog, frame) == TC_ACT_UNSPEC
    gen = rules_gen(prog)
    assert front(prog, one_cpu) == {(40000, 8000): (tenant_id("cidrco"), gen)}
    moved = config(prog.cfg.bpf.pin_root, cidrco=FAR, otherco=NEAR)
    prog.write_config(moved, baseline_buckets(moved))
    assert rules_gen(prog) == gen + 1
    assert run(prog, frame) == TC_ACT_UNSPEC
    assert run(prog, frame) == TC_ACT_UNSPEC
    assert run(prog, frame) == TC_ACT_SHOT  # otherco's own bucket (burst 2), not cidrco's (1 token left)
    assert counts(prog, "otherco") == (2, 1, 0, 0)
    assert counts(prog, "cidrco") == (1, 0, 0, 0)
    assert front(prog, one_cpu) == {(40000, 8000): (tenant_id("otherco"), gen + 1)}


def test_a_header_claimed_flow_stays_with_its_tenant_until_a_syn_reuses_the_tuple(prog, one_cpu):
    client = "10.200.0.1"
    assert run(prog, req(client, 41000, {"X-Tenant-ID": "acme"})) == TC_ACT_UNSPEC
    assert front(prog, one_cpu) == {(41000, 8000): (tenant_id("hdrco"), rules_gen(prog))}
    # Later requests on the connection need not repeat the header: the front answers for hdrco.
    assert run(prog, req(client, 41000, {"X-Tenant-ID": "other"})) == TC_ACT_UNSPEC
    assert run(prog, req(client, 41000)) == TC_ACT_SHOT
    assert counts(prog, "hdrco") == (2, 1, 0, 0)
    # A new connection on the same 4-tuple is unmatched again, in the front as in tenant_flows.
    assert run(prog, ipv4(client, S4, tcp(41000, 8000, SYN))) == TC_ACT_UNSPEC
    assert front(prog, one_cpu) == {}
    assert run(prog, req(client, 41000, {"X-Tenant-ID": "other"})) == TC_ACT_UNSPEC
    assert counts(prog, "hdrco") == (2, 1, 0, 0)
    assert prog.read().counts[UNMATCHED_ID][0] == 1
    assert prog.flows()[(client, 41000, S4, 8000)] == (UNMATCHED_ID, "none")


def test_only_a_rule_change_moves_the_generation_and_an_adopted_pin_keeps_it(bpf):
    with scratch_pin_root() as pin_root:
        cfg = config(pin_root)
        first = dp.Datapath(cfg)
        try:
            first.write_config(cfg, baseline_buckets(cfg))
            gen = rules_gen(first)
            assert gen == 1  # fresh pins: the first rules are a change
            first.heartbeat()
            first.write_config(cfg, baseline_buckets(cfg))  # nothing changed
            first.heartbeat()
            assert rules_gen(first) == gen
        finally:
            first.close()
        moved = config(pin_root, cidrco=FAR, otherco=NEAR)
        d = dp.Datapath(moved)
        try:
            assert d.adopted and rules_gen(d) == gen
            d.write_config(moved, baseline_buckets(moved))
            d.heartbeat()
            assert rules_gen(d) == gen + 1
        finally:
            d.close()
