"""Exports at a thousand tenants (issue 26): per-tenant series only for tenants with traffic within
metrics.retention, which leave and come back with their counts; the exposition built once per snapshot; a scrape
of 1,000 configured tenants with 10 active bounded in series and bytes (counted here; the time is bench/'s)."""

from __future__ import annotations

import pathlib
import re

import pytest
from prometheus_client.exposition import generate_latest

from qosagent import exposition
from qosagent.latency import export as latency_export
from qosagent.metrics import AgentCollector, make_registry
from qosagent.retention import EVERYONE, Retention
from testkit import scale


def series(text: bytes) -> dict[str, float]:
    """Every sample line of a text exposition: 'name{labels}' -> value."""
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def tenants_in(text: bytes) -> set[str]:
    """The configured tenants with a series (quota's unmatched one always has its own)."""
    return set(re.findall(r'tenant="([^"]+)"', text.decode())) - {"unmatched"}


# ---- the rule ----------------------------------------------------------------------------------------------------
def test_a_tenant_is_shown_from_its_traffic_until_the_window_passes_without_any() -> None:
    r = Retention(60.0)
    assert r.shown(0.0, {}) is EVERYONE and r.shown(0.0, {"latency": {}}) is EVERYONE  # nobody counts traffic
    # First seen: with counts (since start, when unknown) shown now; without, not until they move.
    assert r.shown(0.0, {"latency": {"a": (5, 1), "b": (0, 0)}}) == {"a"}
    assert r.shown(30.0, {"latency": {"a": (5, 1), "b": (0, 0)}}) == {"a"}
    assert r.shown(61.0, {"latency": {"a": (5, 1), "b": (0, 0)}}) == set()  # a: idle past the window
    assert r.shown(62.0, {"latency": {"a": (5, 1), "b": (1, 0)}}) == {"b"}
    assert r.shown(70.0, {"latency": {"a": (6, 1), "b": (1, 0)}}) == {"a", "b"}  # a again
    # Any capability's traffic counts; a part missing for a tick forgets nothing.
    assert r.shown(125.0, {"quota": {"a": (0, 0), "b": (3, 0)}}) == {"a", "b"}  # b: new to quota, counted
    assert r.shown(140.0, {"latency": {"a": (6, 1), "b": (1, 0)}, "quota": {"a": (0, 0), "b": (3, 0)}}) == {"b"}
    r.window = 10.0  # a reload that shortens it
    assert r.shown(200.0, {"latency": {"a": (6, 1), "b": (1, 0)}, "quota": {"a": (0, 0), "b": (3, 0)}}) == set()


# ---- through the agent's exposition ------------------------------------------------------------------------------
@pytest.fixture
def node(tmp_path: pathlib.Path) -> AgentCollector:
    return AgentCollector(scale.agent(tmp_path, {"metrics": {"retention": "1m"}}))


def test_idle_tenants_leave_the_scrape_and_come_back_with_their_counts_and_quantiles(node: AgentCollector) -> None:
    a = node.agent
    scale.publish(a, 0.0, 50, {0: 400, 1: 300})
    first = node.body(protobuf=False)
    assert tenants_in(first) == {"t0000", "t0001"}  # 48 tenants configured, never seen: no series
    # t0001 goes on, t0000 stops: still shown within the minute, gone after it.
    scale.publish(a, 30.0, 50, {0: 400, 1: 350})
    assert tenants_in(node.body(protobuf=False)) == {"t0000", "t0001"}
    scale.publish(a, 61.0, 50, {0: 400, 1: 350})
    assert tenants_in(node.body(protobuf=False)) == {"t0001"}
    scale.publish(a, 125.0, 50, {0: 400, 1: 350})
    gone = node.body(protobuf=False)
    assert tenants_in(gone) == set()
    # The per-tier sums still count every tenant, shown or not: they never go down.
    tier = series(gone)
    assert tier['qosagent_latency_tier_response_seconds_count{tier="gold"}'] == 400
    assert tier['qosagent_latency_tier_response_seconds_count{tier="silver"}'] == 350

    # t0000 has traffic again: back with its counts since start and the quantiles of its window.
    scale.publish(a, 130.0, 50, {0: 700, 1: 350})
    back = node.body(protobuf=False)
    assert tenants_in(back) == {"t0000"}
    s = series(back)
    t = scale.tenant_latency(0, 700)
    assert s['qosagent_latency_requests_total{tenant="t0000",tier="gold"}'] == 700
    assert s['qosagent_latency_response_seconds_count{tenant="t0000",tier="gold"}'] == t.response.count == 700
    assert s['qosagent_latency_response_seconds_sum{tenant="t0000",tier="gold"}'] == pytest.approx(
        t.response.sum_ns / 1e9)
    assert s['qosagent_quota_requests_total{tenant="t0000",tier="gold",verdict="admitted"}'] == 700
    for q in latency_export.QUANTILES:
        got = s[f'qosagent_latency_ttft_window_seconds{{quantile="{q}",tenant="t0000",tier="gold"}}']
        assert got == t.ttft_window.quantile(q) and got is not None
    assert s['qosagent_latency_ttft_window_seconds_count{tenant="t0000",tier="gold"}'] == t.ttft_window.count
    # Classic buckets cumulative and ending at the count; the tier sum has t0000's requests too.
    buckets = [v for k, v in s.items() if k.startswith('qosagent_latency_response_seconds_bucket{')
               and 'tenant="t0000"' in k]
    assert buckets == sorted(buckets) and buckets[-1] == 700
    assert s['qosagent_latency_tier_response_seconds_count{tier="gold"}'] == 700


def test_the_exposition_is_built_once_per_snapshot_and_encoded_once_per_format(node: AgentCollector,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    a = node.agent
    scale.publish(a, 0.0, 20, {0: 100})
    built = []
    real = node._build

    def counted(*args: object) -> object:
        built.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(node, "_build", counted)
    text, proto = node.body(protobuf=False), node.body(protobuf=True)
    assert node.body(protobuf=False) is text and node.body(protobuf=True) is proto and len(built) == 1
    assert text == generate_latest(make_registry(a)) and proto == exposition.encode(node.collect())
    scale.publish(a, 0.1, 20, {0: 101})  # the next tick
    assert node.body(protobuf=False) != text and len(built) == 2
    a.config = a.config.model_copy()  # a reload: the same snapshot under another config is built again
    node.body(protobuf=False)
    assert len(built) == 3


# ---- bounded at a thousand tenants -------------------------------------------------------------------------------
# Series a tenant with traffic adds to a scrape with the default config (quota on, admission in dry-run, latency on),
# as docs/operations.md ("Metrics at scale") documents them.
PER_TENANT = {
    "latency histograms (headers, ttft, response, inter_token): 62 each": 248,
    "latency windows (summaries: 3 quantiles, _count, _sum): 5 each": 20,
    "latency counters and gauges (slo, requests, unpaired x2, without TTFT x4, 11 more)": 18,
    "quota (requests x2, connections x2, limit, baseline, bucket tokens)": 7,
    "admission (limit)": 1,
}


def test_a_scrape_of_a_thousand_tenants_is_bounded_by_the_active_ones(node: AgentCollector) -> None:
    a = node.agent
    scale.publish(a, 0.0, 1000, {})
    idle = series(node.body(protobuf=False))
    scale.publish(a, 1.0, 1000, {i: 1000 + 10 * i for i in range(10)})
    text = node.body(protobuf=False)
    busy = series(text)
    assert tenants_in(text) == {scale.name(i) for i in range(10)}
    per_tenant = (len(busy) - len(idle)) / 10
    assert per_tenant == sum(PER_TENANT.values()) == 294
    # A scrape of 1,000 configured tenants, 10 of them active: under 500 KB in text. Without traffic it is the
    # node's own series and the tier sums (3 tiers x 4 signals x 98), whatever the number of tenants.
    assert len(text) < 500_000 and 3 * 4 * 98 < len(idle) < 1_300
    assert len(node.body(protobuf=True)) < len(text) / 2
    # The same node with every tenant shown (as every scrape was before): over fifty times the series.
    assert sum(1 for cap in a.capabilities for m in cap.metrics(a.latest) for _ in m.samples) > 50 * len(busy)
