"""The latency part of a Snapshot as Prometheus families, as status JSON, and as the human table.

All three read the same LatencyPart, so a scrape and `qosagent status` taken on one tick agree.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.samples import Sample

from qosagent.exposition import NativeHistogramMetricFamily
from qosagent.hist import Histogram, export_bounds_ns
from qosagent.latency.config import ClassicBucketsConfig
from qosagent.latency.model import LatencyPart

QUANTILES = (0.5, 0.95, 0.99)
LO_LOG2, HI_LOG2 = 17, 37  # classic edges from 131 us to 137 s
DEFAULT_BUCKETS = ClassicBucketsConfig()


def le_text(ns: int) -> str:
    """A bucket edge in seconds, written exactly (ns are integers; no float rounding in `le`)."""
    whole, frac = divmod(ns, 10**9)
    return f"{whole}.{frac:09d}".rstrip("0").rstrip(".") if frac else f"{whole}.0"


@functools.lru_cache(maxsize=8)
def classic_bounds_ns(cfg: ClassicBucketsConfig = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The classic `le` edges (ns) of latency.classic_buckets: per_octave per power of two, fine_per_octave over the
    powers of two that fine_from..fine_to touch. Every edge is an exact internal bucket edge."""
    lo = min(max(math.floor(math.log2(cfg.fine_from * 1e9)), LO_LOG2), HI_LOG2)
    hi = min(max(math.ceil(math.log2(cfg.fine_to * 1e9)), lo), HI_LOG2)
    return tuple(export_bounds_ns(LO_LOG2, HI_LOG2, cfg.per_octave, (lo, hi, cfg.fine_per_octave)))


def add_histogram(fam: NativeHistogramMetricFamily, lv: list[str], h: Histogram, bounds_ns: tuple[int, ...]) -> None:
    """One series of a latency histogram: classic buckets at bounds_ns and, for protobuf scrapers, the native
    histogram. Every latency histogram family is filled through here."""
    cum = h.cumulative(list(bounds_ns))
    buckets = [(le_text(b), float(c)) for b, c in zip(bounds_ns, cum)] + [("+Inf", float(h.count))]
    fam.add_metric(lv, buckets, h.sum_ns / 1e9)
    fam.add_native(lv, h)


def families(part: LatencyPart | None, programs_attached: int,
             classic_buckets: ClassicBucketsConfig = DEFAULT_BUCKETS) -> Iterable[Metric]:
    yield GaugeMetricFamily("qosagent_latency_programs_attached", "Latency BPF programs attached to their hooks",
                            value=programs_attached)
    if part is None:
        return
    labels = ["tenant", "tier"]
    bounds = classic_bounds_ns(classic_buckets)
    ttfb = NativeHistogramMetricFamily("qosagent_ttfb_seconds", "Time from a request's first bytes read to the "
                                       "first response bytes written, since start", labels=labels)
    resp = NativeHistogramMetricFamily("qosagent_response_seconds", "Time from a request's first bytes read to the "
                                       "last response bytes written before the next request or the close, since "
                                       "start", labels=labels)
    requests = CounterMetricFamily("qosagent_requests", "Requests whose response completed", labels=labels)
    unpaired = CounterMetricFamily("qosagent_requests_unpaired", "Reads and writes that could not be paired: "
                                   "response_without_request (server wrote first), closed_without_response",
                                   labels=labels + ["reason"])
    extra = CounterMetricFamily("qosagent_request_extra_reads", "Reads (sockops mode: segments) of more request bytes "
                                "before any response byte (a request in pieces, or pipelined requests timed as one)",
                                labels=labels)
    conns = CounterMetricFamily("qosagent_connections", "Server-side connections on watched ports tracked",
                                labels=labels)
    untracked = CounterMetricFamily("qosagent_connections_untracked", "Server-side connections on watched ports not "
                                    "tracked: no room for their state (tracepoint mode: socket table full)",
                                    labels=labels)
    mux = CounterMetricFamily("qosagent_connections_multiplexed", "Tracked connections on latency.multiplexed_ports "
                              "(their requests overlap by protocol: counted, not timed)", labels=labels)
    overlapped = CounterMetricFamily("qosagent_requests_overlapped", "Requests whose bytes arrived while the previous "
                                     "response was still being written (pipelining; tracepoint mode only): counted, "
                                     "not timed",
                                     labels=labels)
    lost = CounterMetricFamily("qosagent_latency_observations_lost", "TTFB and response observations dropped "
                               "because their tenant had no slot in the kernel's arrays (never expected)",
                               labels=labels)
    inflight = GaugeMetricFamily("qosagent_requests_in_flight", "Requests started and not yet answered",
                                 labels=labels)
    ttfb_w = SummaryMetricFamily("qosagent_ttfb_window_seconds", "TTFB over the last latency.window: quantiles "
                                 "(absent while the window is empty), count and sum", labels=labels)
    resp_w = SummaryMetricFamily("qosagent_response_window_seconds", "Response time over the last latency.window: "
                                 "quantiles (absent while the window is empty), count and sum", labels=labels)
    for t in part.tenants.values():
        lv = [t.tenant, t.tier]
        add_histogram(ttfb, lv, t.ttfb, bounds)
        add_histogram(resp, lv, t.response, bounds)
        requests.add_metric(lv, t.requests)
        unpaired.add_metric(lv + ["response_without_request"], t.unpaired_send)
        unpaired.add_metric(lv + ["closed_without_response"], t.unpaired_close)
        extra.add_metric(lv, t.extra_reads)
        conns.add_metric(lv, t.connections)
        mux.add_metric(lv, t.multiplexed_connections)
        untracked.add_metric(lv, t.untracked)
        overlapped.add_metric(lv, t.overlapped)
        lost.add_metric(lv, t.lost)
        inflight.add_metric(lv, t.in_flight)
        for fam, h in ((ttfb_w, t.ttfb_window), (resp_w, t.response_window)):
            for q in QUANTILES:
                v = h.quantile(q)
                if v is not None:
                    fam.samples.append(Sample(fam.name, {"tenant": t.tenant, "tier": t.tier, "quantile": str(q)}, v))
            fam.add_metric(lv, h.count, h.sum_ns / 1e9)
    yield from (ttfb, resp, requests, unpaired, extra, conns, mux, untracked, overlapped, lost, inflight, ttfb_w,
                resp_w)
    if part.runqueue is not None:
        rq = NativeHistogramMetricFamily("qosagent_runqueue_latency_seconds", "Time threads of the processes "
                                         "serving watched ports waited runnable for a CPU, since start")
        add_histogram(rq, [], part.runqueue, bounds)
        yield rq


def _quantiles(h: Histogram) -> dict[str, Any]:
    out: dict[str, Any] = {"count": h.count}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = h.quantile(q)
    return out


def slo_state(p99: float | None, slo_p99: float) -> str:
    if slo_p99 <= 0:
        return "-"
    if p99 is None:
        return "no data"
    return "ok" if p99 <= slo_p99 else "breach"


def status(part: LatencyPart | None, slo_p99: dict[str, float]) -> dict[str, Any]:
    if part is None:
        return {}
    tenants = []
    for t in part.tenants.values():
        slo = slo_p99.get(t.tenant, 0.0)
        resp_w = _quantiles(t.response_window)
        tenants.append({
            "tenant": t.tenant, "tier": t.tier, "requests": t.requests, "rate_rps": round(t.rate_rps, 3),
            "in_flight": t.in_flight, "unpaired": t.unpaired, "overlapped": t.overlapped,
            "extra_reads": t.extra_reads, "connections": t.connections,
            "multiplexed_connections": t.multiplexed_connections, "untracked": t.untracked, "lost": t.lost,
            "ttfb": _quantiles(t.ttfb_window), "response": resp_w,
            "ttfb_total": _quantiles(t.ttfb), "response_total": _quantiles(t.response),
            "slo_p99": slo or None, "slo": slo_state(resp_w["p99"], slo),
        })
    out: dict[str, Any] = {"window_s": part.window_s, "tenants": tenants}
    if part.runqueue is not None and part.runqueue_window is not None:
        out["runqueue"] = _quantiles(part.runqueue_window)
        out["runqueue_total"] = _quantiles(part.runqueue)
    return out


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    ms = v * 1000
    return f"{ms:.3f}" if ms < 1 else f"{ms:.1f}"  # loopback and run-queue waits are tens of µs


def render(st: dict[str, Any]) -> str:
    lines = [f"LATENCY (quantiles in ms over the last {st.get('window_s', 0):g}s; requests since start)",
             f"{'TENANT':<16} {'TIER':<8} {'REQUESTS':>9} {'TTFB P50':>9} {'P95':>8} {'P99':>8} "
             f"{'RESP P50':>9} {'P95':>8} {'P99':>8}  SLO"]
    for t in st.get("tenants", []):
        f, r = t["ttfb"], t["response"]
        slo = t["slo"] if t.get("slo_p99") is None else f"{t['slo']} (p99 <= {t['slo_p99'] * 1000:g}ms)"
        lines.append(f"{t['tenant']:<16} {t['tier']:<8} {t['requests']:>9} {_ms(f['p50']):>9} {_ms(f['p95']):>8} "
                     f"{_ms(f['p99']):>8} {_ms(r['p50']):>9} {_ms(r['p95']):>8} {_ms(r['p99']):>8}  {slo}")
        notes = []
        if t.get("unpaired"):
            notes.append(f"{t['unpaired']} unpaired")
        if t.get("overlapped"):
            notes.append(f"{t['overlapped']} overlapped requests not timed")
        if t.get("multiplexed_connections"):
            notes.append(f"{t['multiplexed_connections']} multiplexed connections not timed")
        if notes:
            lines.append(f"{'':<16} ({', '.join(notes)})")
    rq = st.get("runqueue")
    if rq:
        lines.append(f"run-queue latency of serving processes: p50 {_ms(rq['p50'])}  p95 {_ms(rq['p95'])}  "
                     f"p99 {_ms(rq['p99'])} ms ({rq['count']} waits)")
    return "\n".join(lines)
