"""Config -> quota map entries, bucket arithmetic and the status table, without a kernel."""

from __future__ import annotations

import ipaddress

import pytest

from qosagent.config import parse
from qosagent.quota.capability import Quota
from qosagent.quota.rules import MAX_NS, bucket, header_hash, rules
from qosagent.tenants import CidrEntry, TenantLimit, baseline, tenant_entries, tenant_id, with_floor


def cfg(**extra):
    data = {
        "latency": {"ports": [8000]},
        "tiers": {"gold": {"slo_p99": "100ms", "weight": 10, "quota": {"rps": 50, "burst": 100},
                           "floor": {"rps": 5, "burst": 2}},
                  "bronze": {"slo_p99": "1s", "weight": 1}},
        "tenants": [
            {"name": "a", "tier": "gold", "match": {"ports": [8100]}},
            {"name": "b", "tier": "gold", "match": {"cidrs": ["10.1.0.0/16", "2001:db8::/32"], "ports": [8000]},
             "quota": {"rps": 7, "connections_per_s": 3}},
            {"name": "c", "tier": "bronze", "match": {"header": {"name": "X-Tenant-ID", "value": "acme"}}},
        ],
    }
    data.update(extra)
    return parse(data, "test")


def test_rules_follow_the_match_order():
    r = rules(cfg())
    assert r.ports == {8100: tenant_id("a")}
    # CIDRs bound to the tenant's port; IPv4 stored IPv4-mapped, prefix counted after the 16 port bits.
    assert r.cidrs == [CidrEntry(16 + 96 + 16, 8000, b"\0" * 10 + b"\xff\xff" + bytes([10, 1, 0, 0]), tenant_id("b")),
                       CidrEntry(16 + 32, 8000, ipaddress.IPv6Address("2001:db8::").packed, tenant_id("b"))]
    assert r.headers == {header_hash("x-tenant-id", "acme"): tenant_id("c")}
    assert r.watched == [8000, 8100]


def test_cidr_without_ports_applies_on_any_watched_port():
    c = cfg(tenants=[{"name": "d", "tier": "gold", "match": {"cidrs": ["192.168.1.7/24"]}}])
    assert tenant_entries(c)[1] == [CidrEntry(16 + 96 + 24, 0, b"\0" * 10 + b"\xff\xff" + bytes([192, 168, 1, 0]),
                                              tenant_id("d"))]


def test_header_hash_is_case_insensitive_in_the_name_only():
    assert header_hash("X-Tenant-ID", "acme") == header_hash("x-tenant-id", "acme")
    assert header_hash("X-Tenant-ID", "acme") != header_hash("X-Tenant-ID", "ACME")
    # FNV-1a 64 of "x-tenant-id:acme", as the classifier computes it byte by byte.
    h = 0xCBF29CE484222325
    for ch in b"x-tenant-id:acme":
        h = ((h ^ ch) * 0x100000001B3) % 2**64
    assert header_hash("X-Tenant-ID", "acme") == h


def test_baseline_takes_tenant_fields_over_tier_defaults():
    b = baseline(cfg())
    assert b["a"].requests == TenantLimit(50, 100)
    assert b["b"].requests == TenantLimit(7, 100)  # own rps, the tier's burst
    assert b["b"].connections == TenantLimit(3, 3)
    assert b["a"].floor == TenantLimit(5, 2)
    assert b["c"].requests is None and b["c"].connections is None


@pytest.mark.parametrize("rps,burst,interval,tau", [
    (20, 2, 50_000_000, 100_000_000),
    (20, 0, 50_000_000, 50_000_000),  # a bucket always holds one token
    (0, 10, 1_000_000_000, 0),  # rps 0 sheds
    (1e-10, 10**9, MAX_NS, MAX_NS),  # clamped: the kernel's arithmetic cannot overflow
])
def test_bucket(rps, burst, interval, tau):
    b = bucket(rps, burst)
    assert (b.interval_ns, b.tau_ns) == (interval, tau)


def test_overrides_never_go_below_the_floor():
    assert with_floor(TenantLimit(1, 1), TenantLimit(5, 2)) == TenantLimit(5, 2)
    assert with_floor(TenantLimit(9, 1), None) == TenantLimit(9, 1)


def test_render_shows_every_tenant():
    st = {"interfaces": ["eth0", "lo"], "pins": "/sys/fs/bpf/qosagent/quota-v2", "unmatched_packets": 3,
          "others_on_hook": ["other filter: lo ingress pref 1 handle 0x7 bpf"],
          "tenants": [{"tenant": "a", "tier": "gold", "limit": {"rps": 5.0, "burst": 2},
                       "baseline": {"rps": 50.0, "burst": 100}, "admitted": 10, "dropped": 2, "conn_admitted": 1,
                       "conn_dropped": 0, "admitted_rps": 4.5, "dropped_rps": 1.0, "bucket_tokens": 1.5},
                      {"tenant": "c", "tier": "bronze", "limit": None, "baseline": None, "admitted": 0,
                       "dropped": 0, "conn_admitted": 0, "conn_dropped": 0, "admitted_rps": 0.0,
                       "dropped_rps": 0.0, "bucket_tokens": None}]}
    text = Quota.render(st)
    assert "other filter: lo ingress pref 1" in text
    lines = text.splitlines()
    a = next(line for line in lines if line.startswith("a "))
    assert a.split() == ["a", "gold", "5/2", "50/100", "4.5", "1.0", "10", "2", "1", "0", "1.5"]
    assert next(line for line in lines if line.startswith("c ")).split()[2:4] == ["-", "-"]


def test_metrics_pass_promtool(tmp_path):
    import shutil
    import subprocess

    from prometheus_client import CollectorRegistry, generate_latest

    from qosagent.capability import AgentContext
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.quota.model import QuotaPart, TenantQuota
    from qosagent.snapshot import Snapshot

    part = QuotaPart({"a": TenantQuota("a", "gold", TenantLimit(50, 100), TenantLimit(5, 2), 10, 2, 1, 0, 4.5, 1.0,
                                       1.5)}, unmatched_packets=3)
    q = Quota(AgentContext(config=cfg(), hostfs=HostFS("/"), gpu=NoGpu()))
    snap = Snapshot.build(1, 0.0, 0.0, {"quota": part})

    class C:
        def collect(self):
            return q.metrics(snap)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    assert 'qosagent_quota_requests_total{tenant="a",tier="gold",verdict="dropped"} 2.0' in text
    assert 'qosagent_quota_limit_rps{tenant="a",tier="gold"} 5.0' in text
    assert 'qosagent_quota_bucket_tokens{tenant="a",tier="gold"} 1.5' in text
    if shutil.which("promtool"):
        out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_a_reloads_rewrite_clamps_the_overrides_to_the_tier_floor_as_the_writer_does():
    """Admission's overrides are kept as it gave them; a reload writes them again (quota's _write) and must clamp
    them as LimitsWriter does: before, tenant a's 1 rps went to the maps under its gold floor of 5 rps."""
    from qosagent.capability import AgentContext
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.quota.capability import _Written
    from qosagent.quota.limits import LimitsWriter

    told: list[dict[int, object]] = []

    class Datapath:
        def write_config(self, *args: object) -> None:
            pass

        def set_overrides(self, overrides: dict[int, object]) -> None:
            told.append(dict(overrides))

        def attach(self, *args: object) -> list[str]:
            return []

    c = cfg()
    q = Quota(AgentContext(config=c, hostfs=HostFS("/"), gpu=NoGpu("test")))
    q.datapath = Datapath()  # type: ignore[assignment]
    cut = {"a": TenantLimit(1, 1), "c": TenantLimit(3, 4)}  # c's bronze tier has no floor
    q._write(_Written(c, [], q._derive(c), cut))
    q.specs = q._derive(c)[0]
    LimitsWriter(q).set_overrides(cut)
    assert told[0] == told[1] == {tenant_id("a"): bucket(5, 2), tenant_id("c"): bucket(3, 4)}
