"""One SLO verdict per tick: judged once, and every reader (latency's status and metrics, admission) shows the same."""

from __future__ import annotations

import textwrap

import pytest

from qosagent.admission.inputs import slo_verdict, tick_input
from qosagent.config import parse_text
from qosagent.hist import Histogram
from qosagent.latency import export
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.slo import BREACH, NO_SLO, OK, SloVerdict, tier
from qosagent.snapshot import Snapshot

CONFIG = textwrap.dedent("""
    tiers:
      gold:   {slo_p99: 120ms, weight: 10}
      bronze: {slo_p99: 1200ms, weight: 1}
    tenants:
      - {name: acme, tier: gold, match: {cidrs: [127.0.0.2/32]}}
      - {name: shop, tier: gold, match: {cidrs: [127.0.0.4/32]}}
      - {name: hobby, tier: bronze, match: {cidrs: [127.0.0.3/32]}}
    latency: {enabled: false}
    admission: {enabled: true}
""")


def tenant(name: str, tier_: str, ms: list[float]) -> TenantLatency:
    h = Histogram.of([int(v * 1e6) for v in ms])
    return TenantLatency(name, tier_, len(ms), h, h, h, h, h, h, h, h, rate_rps=10.0)


def part(cfg) -> LatencyPart:
    tenants = {"acme": tenant("acme", "gold", [100.0] * 50), "shop": tenant("shop", "gold", [200.0] * 50),
               "hobby": tenant("hobby", "bronze", [50.0] * 10), "gone": tenant("gone", "bronze", [9000.0])}
    slos = {t.name: cfg.tiers[t.tier].slo_p99 for t in cfg.tenants}
    adm = cfg.admission
    verdict = SloVerdict({n: (t.tier, t.window(adm.signal)) for n, t in tenants.items()}, slos,
                         {"gold": 0.12, "bronze": 1.2}, adm.signal, adm.quantile, adm.near_slo, adm.healthy_below)
    return LatencyPart(1.0, tenants, slo=slos, verdict=verdict)


def test_the_tier_rule_is_told_in_one_place() -> None:
    assert tier(None, 0.12, 0.8, 0.9) == tier(None, 0.12, 0.8, 0.9)
    t = tier(0.10, 0.12, 0.8, 0.9)
    assert (t.over, t.near, t.healthy) == (False, True, True)
    t = tier(0.13, 0.12, 0.8, 0.9)
    assert (t.over, t.near, t.healthy) == (True, True, False)
    assert tier(None, 0.12, 0.8, 0.9).healthy and not tier(None, 0.12, 0.8, 0.9).near


def test_every_reader_shows_the_verdict_collect_judged() -> None:
    cfg = parse_text(CONFIG, "t.yaml")
    p = part(cfg)
    v = p.verdict
    assert v is not None
    # Judged once: every read of the part returns the same verdict, each half kept after its first read.
    assert v.tiers is v.tiers and v.tenants is v.tenants
    assert p.judged(cfg.admission.signal, cfg.admission.quantile) is v
    snap = Snapshot.build(1, 1.0, 1.0, {"latency": p})
    assert slo_verdict(p, cfg) is v
    inp = tick_input(snap, cfg, {})
    assert {n: t.verdict for n, t in inp.tiers.items()} == dict(v.tiers)
    # A tier's quantile is over its configured tenants merged (acme 100 ms and shop 200 ms: P95 over the SLO);
    # a tenant a reload removed has a verdict of its own and no SLO, and is no part of any tier.
    assert v.tiers["gold"].over and v.tiers["gold"].observed == pytest.approx(0.2, rel=0.07)
    assert v.tiers["bronze"].observed == pytest.approx(0.05, rel=0.07)
    st = {r["tenant"]: r for r in export.status(p, dict(p.slo), cfg.admission.signal, cfg.admission.quantile)
          ["tenants"]}
    assert {n: r["slo"] for n, r in st.items()} == {"acme": OK, "shop": BREACH, "hobby": OK, "gone": NO_SLO}
    assert {n: r["slo_latency"] for n, r in st.items()} == {n: t.latency for n, t in v.tenants.items()}
    assert v.near_slo == frozenset({"gold"})


def test_a_verdict_for_another_signal_is_judged_by_the_same_rule() -> None:
    cfg = parse_text(CONFIG, "t.yaml")
    p = part(cfg)
    other = p.judged("headers", 0.5)
    assert other is not p.verdict and other.tenants["shop"].latency == pytest.approx(0.2, rel=0.07)
