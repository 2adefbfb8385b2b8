"""The protobuf exposition, read back by a decoder written here from the wire format (not by the encoder's code),
checked against known bytes and against the text exposition of the same collect(); the classic layout; and the
choice of format from the Accept header, through the agent's real metrics server."""

from __future__ import annotations

import math
import random
import struct
import urllib.request
from typing import Any, Iterable

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qosagent import config as config_mod
from qosagent import exposition
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hist import Histogram, bucket_index, bucket_upper
from qosagent.hostfs import HostFS
from qosagent.latency import export
from qosagent.latency.config import ClassicBucketsConfig
from qosagent.latency.model import SHARED_TIER, LatencyPart, TenantLatency
from qosagent.metrics import MetricsServer
from qosagent.nativehist import native

# ---- an independent decoder ---------------------------------------------------------------------------------------
TYPES = {0: "counter", 1: "gauge", 2: "summary", 3: "untyped", 4: "histogram"}


def read_varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        byte = b[i]
        n |= (byte & 0x7F) << shift
        i += 1
        shift += 7
        if not byte & 0x80:
            return n, i


def unzig(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def fields(b: bytes) -> list[tuple[int, int, Any]]:
    out = []
    i = 0
    while i < len(b):
        key, i = read_varint(b, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = read_varint(b, i)
        elif wire == 1:
            v = struct.unpack_from("<d", b, i)[0]
            i += 8
        elif wire == 2:
            n, i = read_varint(b, i)
            v = b[i:i + n]
            i += n
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((field, wire, v))
    assert i == len(b)
    return out


def sints(wire: int, v: Any) -> list[int]:
    """A repeated sint64, packed (one LEN field) or not (one varint per element)."""
    if wire == 0:
        return [unzig(v)]
    out, i = [], 0
    while i < len(v):
        n, i = read_varint(v, i)
        out.append(unzig(n))
    return out


def decode_histogram(b: bytes) -> dict[str, Any]:
    h: dict[str, Any] = {"buckets": [], "spans": [], "deltas": []}
    for f, w, v in fields(b):
        if f == 1:
            h["count"] = v
        elif f == 2:
            h["sum"] = v
        elif f == 3:
            bk = {ff: vv for ff, _, vv in fields(v)}
            h["buckets"].append((bk[2], bk.get(1, 0)))
        elif f == 5:
            h["schema"] = unzig(v)
        elif f == 6:
            h["zero_threshold"] = v
        elif f == 7:
            h["zero_count"] = v
        elif f == 12:
            sp = {ff: vv for ff, _, vv in fields(v)}
            h["spans"].append((unzig(sp.get(1, 0)), sp.get(2, 0)))
        elif f == 13:
            h["deltas"] += sints(w, v)
    return h


def decode_metric(b: bytes) -> dict[str, Any]:
    m: dict[str, Any] = {"labels": {}}
    for f, _, v in fields(b):
        if f == 1:
            lp = {ff: vv.decode() for ff, _, vv in fields(v)}
            m["labels"][lp.get(1, "")] = lp.get(2, "")
        elif f in (2, 3, 5):  # gauge, counter, untyped: value is field 1
            m["value"] = {ff: vv for ff, _, vv in fields(v)}.get(1, 0.0)
        elif f == 4:
            s: dict[str, Any] = {"quantiles": {}}
            for ff, _, vv in fields(v):
                if ff == 1:
                    s["count"] = vv
                elif ff == 2:
                    s["sum"] = vv
                elif ff == 3:
                    q = {a: c for a, _, c in fields(vv)}
                    s["quantiles"][q[1]] = q[2]
            m["summary"] = s
        elif f == 7:
            m["histogram"] = decode_histogram(v)
    return m


def decode(stream: bytes) -> list[dict[str, Any]]:
    """Delimited MetricFamily messages."""
    out, i = [], 0
    while i < len(stream):
        n, i = read_varint(stream, i)
        fam: dict[str, Any] = {"metrics": [], "type": 0}
        for f, _, v in fields(stream[i:i + n]):
            if f == 1:
                fam["name"] = v.decode()
            elif f == 2:
                fam["help"] = v.decode()
            elif f == 3:
                fam["type"] = v
            elif f == 4:
                fam["metrics"].append(decode_metric(v))
        out.append(fam)
        i += n
    return out


def native_buckets(h: dict[str, Any]) -> dict[int, int]:
    out, k, j, c = {}, 0, 0, 0
    for off, length in h["spans"]:
        k += off
        for _ in range(length):
            c += h["deltas"][j]
            out[k] = c
            j, k = j + 1, k + 1
    return out


# ---- wire format -------------------------------------------------------------------------------------------------
def test_varints_and_zigzag_against_known_bytes() -> None:
    assert exposition.varint(0) == b"\x00"
    assert exposition.varint(1) == b"\x01"
    assert exposition.varint(300) == b"\xac\x02"
    assert exposition.varint(-1) == b"\xff" * 9 + b"\x01"
    assert [exposition.zigzag(n) for n in (0, -1, 1, -2, 2, -64, 63)] == [0, 1, 2, 3, 4, 127, 126]
    assert exposition.zigzag(-(2**63)) == 2**64 - 1


def test_a_gauge_family_against_known_bytes() -> None:
    out = exposition.encode([GaugeMetricFamily("g", "h", value=1.5)])
    gauge = b"\x09" + struct.pack("<d", 1.5)  # Gauge.value (1, fixed64)
    metric = b"\x12" + bytes([len(gauge)]) + gauge  # Metric.gauge (2)
    body = b"\x0a\x01g" + b"\x12\x01h" + b"\x18\x01" + b"\x22" + bytes([len(metric)]) + metric
    assert out == bytes([len(body)]) + body


def test_a_native_histogram_against_known_bytes() -> None:
    fam = exposition.NativeHistogramMetricFamily("x", "d", labels=["a"])
    h = Histogram.of([45_000_000])
    fam.add_metric(["b"], [("+Inf", 1.0)], 0.045)
    fam.add_native(["b"], h)
    [got] = decode(exposition.encode([fam]))
    assert got["name"] == "x" and got["type"] == 4
    hist = got["metrics"][0]["histogram"]
    assert got["metrics"][0]["labels"] == {"a": "b"}
    assert hist["count"] == 1 and hist["sum"] == 0.045 and hist["buckets"] == []  # +Inf is implied by the count
    assert hist["schema"] == 3 and hist["zero_threshold"] == 1e-9 and hist.get("zero_count", 0) == 0
    # 45 ms: 2^(k/8) s with k = ceil(8 * log2(0.045)) = -35; its internal bucket lies inside that native one.
    assert native_buckets(hist) == {-35: 1}
    assert 2 ** (-36 / 8) < 0.045 <= 2 ** (-35 / 8)


def test_an_empty_native_histogram_is_still_native() -> None:
    fam = exposition.NativeHistogramMetricFamily("x", "d")
    fam.add_metric([], [("+Inf", 0.0)], 0.0)
    fam.add_native([], Histogram())
    hist = decode(exposition.encode([fam]))[0]["metrics"][0]["histogram"]
    assert hist["spans"] == [(0, 0)] and hist["zero_threshold"] > 0


# ---- the same content as text ------------------------------------------------------------------------------------
def lognormal(median_s: float, sigma: float, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.lognormvariate(math.log(median_s * 1e9), sigma)) for _ in range(n)]


def part() -> LatencyPart:
    tenants = {}
    for name, vals in (("chat", lognormal(0.045, 0.2, 5000, 1)), ("idle", []), ("wide", lognormal(0.01, 1.0, 500, 2))):
        h = Histogram.of(vals)
        tenants[name] = TenantLatency(tenant=name, tier="gold", requests=h.count, headers=h, ttft=h, response=h,
                                      inter_token=h, headers_window=h, ttft_window=h, response_window=h,
                                      inter_token_window=h, rate_rps=1.0, unpaired_send=2, in_flight=3)
    gold, shared = Histogram.of(lognormal(0.00005, 1.0, 300, 3)), Histogram.of(lognormal(0.002, 1.0, 20, 4))
    rq = gold + shared
    return LatencyPart(10.0, tenants, rq, rq, {"gold": gold, SHARED_TIER: shared}, {"gold": gold, SHARED_TIER: shared})


class Collector:
    def __init__(self, metrics: list[Any]):
        self.metrics = metrics

    def collect(self) -> Iterable[Any]:
        return iter(self.metrics)


def everything() -> list[Any]:
    extra = CounterMetricFamily("qosagent_things", "Things, with a created time", labels=["k"])
    extra.add_metric(["v"], 7, created=1700000000.5)
    summary = SummaryMetricFamily("qosagent_plain_summary", "A summary", count_value=4, sum_value=2.5)
    return list(export.families(part(), 5, "ttft", 0.95)) + [extra, summary,
                                                             GaugeMetricFamily("qosagent_nan", "NaN", math.nan)]


def samples_of_text(text: str) -> set[tuple[str, frozenset, float]]:
    out = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: (str(float(v)) if k == "le" else v) for k, v in s.labels.items()}
            out.add((s.name, frozenset(labels.items()), "nan" if math.isnan(s.value) else s.value))
    return out


def samples_of_protobuf(fams: list[dict[str, Any]]) -> set[tuple[str, frozenset, float]]:
    out = set()

    def add(name: str, labels: dict[str, str], v: float) -> None:
        out.add((name, frozenset(labels.items()), "nan" if math.isnan(v) else float(v)))

    for fam in fams:
        name, t = fam["name"], TYPES[fam["type"]]
        for m in fam["metrics"]:
            lb = m["labels"]
            if t in ("counter", "gauge", "untyped"):
                add(name, lb, m["value"])
            elif t == "summary":
                s = m["summary"]
                for q, v in s["quantiles"].items():
                    add(name, {**lb, "quantile": str(q)}, v)
                add(name + "_count", lb, s.get("count", 0))
                add(name + "_sum", lb, s.get("sum", 0.0))
            else:
                h = m["histogram"]
                for ub, c in h["buckets"]:
                    add(name + "_bucket", {**lb, "le": str(ub)}, c)
                add(name + "_bucket", {**lb, "le": "inf"}, h.get("count", 0))
                add(name + "_count", lb, h.get("count", 0))
                add(name + "_sum", lb, h.get("sum", 0.0))
    return out


def test_protobuf_carries_every_sample_the_text_format_does() -> None:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(everything()))  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    fams = decode(exposition.encode(reg.collect()))
    assert samples_of_protobuf(fams) == samples_of_text(text)
    names = [f["name"] for f in fams]
    assert len(names) == len(set(names))
    assert "qosagent_latency_requests_total" in names and "qosagent_things_created" in names
    helps = {f["name"]: f["help"] for f in fams}
    assert helps["qosagent_latency_response_seconds"].startswith("Time from a request's first bytes")


def test_native_histograms_beside_classic_buckets_and_their_quantiles() -> None:
    fams = {f["name"]: f for f in decode(exposition.encode(everything()))}
    resp = {m["labels"]["tenant"]: m["histogram"] for m in fams["qosagent_latency_response_seconds"]["metrics"]}
    assert set(resp) == {"chat", "idle", "wide"}
    assert resp["idle"]["spans"] == [(0, 0)] and resp["idle"].get("count", 0) == 0
    chat = resp["chat"]
    assert len(chat["buckets"]) == len(export.classic_bounds_ns())
    b = native_buckets(chat)
    assert sum(b.values()) + chat.get("zero_count", 0) == chat["count"] == 5000
    assert b == native(part().tenants["chat"].response).buckets()
    # Prometheus' histogram_quantile (linear inside a native bucket) over the decoded buckets: near the truth.
    vals = sorted(lognormal(0.045, 0.2, 5000, 1))
    for q in (0.5, 0.95, 0.99):
        rank, seen = q * 5000, 0
        for k in sorted(b):
            if seen + b[k] >= rank:
                lo, hi = 2 ** ((k - 1) / 8), 2 ** (k / 8)
                est = lo + (hi - lo) * (rank - seen) / b[k]
                break
            seen += b[k]
        truth = vals[math.ceil(q * 5000) - 1] / 1e9
        assert abs(est - truth) / truth < 0.03, (q, est, truth)
    rq = {m["labels"]["tier"]: m["histogram"] for m in fams["qosagent_latency_runqueue_seconds"]["metrics"]}
    # A series per tier the serving processes serve, and the processes serving several apart.
    assert {tier: h["count"] for tier, h in rq.items()} == {"gold": 300, SHARED_TIER: 20}


# ---- classic layout ----------------------------------------------------------------------------------------------
def test_default_classic_layout_and_its_cost() -> None:
    """A tenant's histograms have 4 edges per power of two in the fine range, the tiers' and the run queue's 8."""
    bounds, tier = export.classic_bounds_ns(), export.classic_bounds_ns(tier=True)
    assert len(bounds) + 1 + 2 == 62  # edges, +Inf, _sum and _count: series per tenant per histogram
    assert len(tier) + 1 + 2 == 98  # per tier per histogram
    for edges, per_octave in ((bounds, 4), (tier, 8)):
        assert all(bucket_upper(bucket_index(b)) == b for b in edges)
        assert all(int(round(float(export.le_text(b)) * 1e9)) == b for b in edges)
        fine = [b for b in edges if 8_000_000 < b < 4_000_000_000]
        assert all(0 < (b2 - b1) / b1 <= 1 / per_octave for b1, b2 in zip(fine, fine[1:]))
    assert set(bounds) <= set(tier)
    old = export.classic_bounds_ns(ClassicBucketsConfig(fine_per_octave=2))
    assert len(old) + 3 == 44


def test_classic_layout_config_is_checked() -> None:
    for bad in ({"fine_from": "5s", "fine_to": "1s"}, {"per_octave": 4, "fine_per_octave": 2}, {"per_octave": 3},
                {"per_octave": 4, "tier_fine_per_octave": 2}):
        with pytest.raises(config_mod.ConfigError):
            config_mod.parse({"latency": {"classic_buckets": bad}}, "t")
    cfg = config_mod.parse({"latency": {"classic_buckets": {"fine_from": "100us", "fine_to": "1h"}}}, "t")
    bounds = export.classic_bounds_ns(cfg.latency.classic_buckets)  # clamped to 131 us .. 137 s
    assert bounds[0] == 1 << 17 and bounds[-1] == 1 << 37 and len(bounds) == 4 * 20 + 1
    assert len(export.classic_bounds_ns(cfg.latency.classic_buckets, tier=True)) == 8 * 20 + 1


# ---- content negotiation -----------------------------------------------------------------------------------------
PROM_242_NATIVE = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited,"
                   "application/openmetrics-text;version=1.0.0;q=0.8,application/openmetrics-text;version=0.0.1;"
                   "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROM_242_DEFAULT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROM_3 = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5,"
          "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=1.0.0;"
          "escaping=allow-utf-8;q=0.3,*/*;q=0.2")


@pytest.mark.parametrize("accept, proto", [
    (PROM_242_NATIVE, True),
    (PROM_3, True),
    ("application/vnd.google.protobuf; proto=io.prometheus.client; encoding=delimited", True),
    ("APPLICATION/VND.GOOGLE.PROTOBUF;proto=\"io.prometheus.client.MetricFamily\";encoding=delimited", True),
    (PROM_242_DEFAULT, False),
    (None, False),
    ("", False),
    ("*/*", False),
    ("text/plain", False),
    ("application/vnd.google.protobuf", False),  # which message, which framing?
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=zz", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=7", False),
    ("text/plain;q=1,application/vnd.google.protobuf;proto=io.prometheus.client;encoding=delimited;q=0.9", False),
    (";;;,,,=;q=;", False),
    ("\x00\xff garbage", False),
])
def test_protobuf_only_when_asked_for(accept: str | None, proto: bool) -> None:
    assert exposition.wants_protobuf(accept) is proto


class Latency:
    name = "latency"

    def metrics(self, _snapshot: Any, _shown: Any) -> Iterable[Any]:
        return export.families(part(), 5, "ttft", 0.95)

    def traffic(self, _snapshot: Any) -> dict[str, tuple[int, ...]]:
        return {}


@pytest.fixture
def endpoint() -> Any:
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0"},
                            **{c: {"enabled": False} for c in ("latency", "quota", "admission", "dvfs", "placement")}},
                           "t")
    agent = Agent(cfg, HostFS("/"), gpu=NoGpu("test"))
    agent.capabilities.append(Latency())  # type: ignore[arg-type]
    srv = MetricsServer(agent, cfg.metrics.listen)
    srv.start()
    try:
        yield f"http://127.0.0.1:{srv.address[1]}/metrics"
    finally:
        srv.close()


def get(url: str, accept: str | None) -> tuple[str, bytes]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept is not None else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return r.headers["Content-Type"], r.read()


def test_metrics_server_negotiates(endpoint: str) -> None:
    ctype, body = get(endpoint, PROM_242_NATIVE)
    assert ctype == exposition.CONTENT_TYPE
    names = {f["name"] for f in decode(body)}
    assert {"qosagent_ticks_total", "qosagent_tier_slo_p99_seconds", "qosagent_latency_response_seconds"} <= names
    for odd in (None, PROM_242_DEFAULT, "application/vnd.google.protobuf", "\x7f;q=;;"):
        ctype, body = get(endpoint, odd)
        assert ctype.startswith("text/plain") and b"# TYPE qosagent_ticks_total counter" in body


def test_a_failing_encoder_costs_the_format_not_the_scrape(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_metrics: Any) -> bytes:
        raise RuntimeError("bug")

    monkeypatch.setattr(exposition, "encode", broken)
    ctype, body = get(endpoint, PROM_242_NATIVE)
    assert ctype.startswith("text/plain") and b"qosagent_latency_response_seconds_bucket" in body


# ---- the latency families' old names, kept one release -------------------------------------------------------------
SUFFIXES = ("", "_total", "_created", "_bucket", "_count", "_sum")


def _under(samples: set[tuple[str, frozenset, float]], name: str) -> set[tuple[str, frozenset, float]]:
    """The samples of one family, with the family's name taken off (what is left: the sample suffix)."""
    return {(n[len(name):], lb, v) for n, lb, v in samples if n in {name + s for s in SUFFIXES}}


def test_each_old_latency_name_is_still_exposed_and_equals_its_new_one() -> None:
    """The families grouped under qosagent_latency_ keep their old names as deprecated copies: in the text and the
    protobuf exposition (native histograms included), the same samples under either name, and a HELP that says so."""
    import dataclasses

    p = dataclasses.replace(part(), unobserved={"awaiting_request": 2, "not_hooked": 1, "no_room": 0})
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(list(export.families(p, 5, "ttft", 0.95, deprecated=True))))  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    # Counters are named with their _total in protobuf.
    proto = {f["name"].removesuffix("_total") if TYPES[f["type"]] == "counter" else f["name"]: f
             for f in decode(exposition.encode(reg.collect()))}
    # Every family that was renamed is produced here, under both names.
    assert set(export.RENAMED) | set(export.RENAMED.values()) <= set(proto)
    text_samples, proto_samples = samples_of_text(text), samples_of_protobuf(list(proto.values()))
    for new, old in export.RENAMED.items():
        assert new.startswith("qosagent_latency_") and not old.startswith("qosagent_latency_")
        for samples in (text_samples, proto_samples):
            assert _under(samples, new), new
            assert _under(samples, old) == _under(samples, new), old
        assert (proto[old]["type"], proto[old]["metrics"]) == (proto[new]["type"], proto[new]["metrics"]), old
        assert proto[old]["help"].startswith(f"Deprecated: the name of {new} before 0.2.0, removed in 0.3.0"), old
        assert proto[old]["help"].endswith(proto[new]["help"]), old
    assert "qosagent_latency_programs_attached" not in export.RENAMED  # already grouped: one name
    # The run-queue family's old name stays what it was: one series without labels, every serving process's (the
    # tiers' sum), not a copy of the new name's series by tier.
    runq, old = export.RUNQ.name, export.RUNQ_OLD.name
    assert runq not in export.RENAMED
    assert [m["labels"] for m in proto[runq]["metrics"]] == [{"tier": "gold"}, {"tier": SHARED_TIER}]
    assert [(m["labels"], m["histogram"]["count"]) for m in proto[old]["metrics"]] == [({}, 320)]
    assert proto[old]["help"].startswith(f"Deprecated: the name of {runq} before 0.2.0, removed in 0.3.0"), old
    for samples in (text_samples, proto_samples):
        by_le: dict[tuple[str, str], float] = {}
        for suffix, labels, v in _under(samples, runq):
            key = (suffix, dict(labels).get("le", ""))
            by_le[key] = by_le.get(key, 0.0) + v
        assert {(suffix, dict(labels).get("le", "")): v for suffix, labels, v in _under(samples, old)} == by_le


def test_the_old_latency_names_come_only_with_metrics_deprecated_names_on() -> None:
    from qosagent.capability import AgentContext
    from qosagent.latency.capability import Latency as LatencyCapability
    from qosagent.snapshot import Snapshot

    snap = Snapshot.build(1, 0.0, 0.0, {"latency": part()})

    def names(deprecated: bool) -> set[str]:
        cfg = config_mod.parse({"metrics": {"deprecated_names": deprecated}}, "t")
        cap = LatencyCapability(AgentContext(config=cfg, hostfs=HostFS("/nonexistent"), gpu=NoGpu("t")))
        return {f.name for f in cap.metrics(snap)}

    on, off = names(True), names(False)
    assert "qosagent_ttft_seconds" in on and "qosagent_requests" in on
    assert off == on - set(export.RENAMED.values()) - {export.RUNQ_OLD.name}
    assert "qosagent_latency_ttft_seconds" in off and export.RUNQ_OLD.name in on
    assert not config_mod.parse({}, "t").metrics.deprecated_names  # off unless turned on
