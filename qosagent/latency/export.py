"""The latency part of a Snapshot as Prometheus families, as status JSON, and as the human table.

All three read the same LatencyPart, so a scrape and `qosagent status` taken on one tick agree.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.samples import Sample

from qosagent import exposition
from qosagent.exposition import NativeHistogramMetricFamily
from qosagent.hist import Histogram, export_bounds_ns
from qosagent.latency import bpfmaps as bm
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


# The latencies of a response, by the one name the config, the model's fields, status and the metrics use: help.
SIGNALS = {
    "headers": ("Time from a request's first bytes to the first response bytes written (for HTTP, the "
                "response headers: when the server accepted the work)"),
    "ttft": ("Time from a request's first bytes to the first response body byte (time to first token; "
             "HTTP/1.x responses only, interim 1xx responses passed over)"),
    "response": ("Time from a request's first bytes to the last response byte (where its framing "
                 "says the body ends: Content-Length, chunked; else the last write before the next request or the "
                 "close)"),
    "inter_token": ("Gaps between successive body writes of a response (inter-token latency: a write "
                    "is one token or a group of them, as the server flushes)"),
}


# The families' names before they were grouped under qosagent_latency_ (0.2.0), kept as deprecated copies
# (exposition.with_deprecated).
RENAMED = {
    **{f"qosagent_latency_{name}_seconds": f"qosagent_{name}_seconds" for name in SIGNALS},
    **{f"qosagent_latency_{name}_window_seconds": f"qosagent_{name}_window_seconds" for name in SIGNALS},
    "qosagent_latency_slo_seconds": "qosagent_slo_latency_seconds",
    "qosagent_latency_runqueue_seconds": "qosagent_runqueue_latency_seconds",
    **{f"qosagent_latency_{name}": f"qosagent_{name}" for name in (
        "requests", "requests_unpaired", "requests_pipelined", "requests_overlapped", "requests_in_flight",
        "responses_without_ttft", "responses_interim", "responses_framed", "connections", "connections_untracked",
        "connections_adopted", "connections_multiplexed", "connections_unobserved")},
}


def with_deprecated(fams: Iterable[Metric]) -> Iterator[Metric]:
    return exposition.with_deprecated(fams, RENAMED, "before 0.2.0")


def add_histogram(fam: NativeHistogramMetricFamily, lv: list[str], h: Histogram, bounds_ns: tuple[int, ...]) -> None:
    """One series of a latency histogram: classic buckets at bounds_ns and, for protobuf scrapers, the native
    histogram. Every latency histogram family is filled through here."""
    cum = h.cumulative(list(bounds_ns))
    buckets = [(le_text(b), float(c)) for b, c in zip(bounds_ns, cum)] + [("+Inf", float(h.count))]
    fam.add_metric(lv, buckets, h.sum_ns / 1e9)
    fam.add_native(lv, h)


def families(part: LatencyPart | None, programs_attached: int, signal: str, quantile: float,
             classic_buckets: ClassicBucketsConfig = DEFAULT_BUCKETS) -> Iterable[Metric]:
    yield GaugeMetricFamily("qosagent_latency_programs_attached", "Latency BPF programs attached to their hooks",
                            value=programs_attached)
    if part is None:
        return
    labels = ["tenant", "tier"]
    bounds = classic_bounds_ns(classic_buckets)
    hists = {name: NativeHistogramMetricFamily(f"qosagent_latency_{name}_seconds", f"{help_}, since start",
                                               labels=labels)
             for name, help_ in SIGNALS.items()}
    windows = {name: SummaryMetricFamily(f"qosagent_latency_{name}_window_seconds",
                                         f"{help_}, over the last latency.window: quantiles (absent while the window "
                                         "is empty), count and sum", labels=labels)
               for name, help_ in SIGNALS.items()}
    slo = GaugeMetricFamily("qosagent_latency_slo_seconds", "The latency the SLO is judged on, as admission judges "
                            "it: admission.quantile of admission.signal over the last latency.window (absent while "
                            "the window is empty)", labels=labels + ["signal", "slo_quantile"])
    requests = CounterMetricFamily("qosagent_latency_requests", "Requests whose response completed", labels=labels)
    unpaired = CounterMetricFamily("qosagent_latency_requests_unpaired", "Reads and writes that could not be "
                                   "paired: response_without_request (server wrote first), closed_without_response",
                                   labels=labels + ["reason"])
    no_ttft = CounterMetricFamily("qosagent_latency_responses_without_ttft", "Responses with no time to first "
                                  "token, by reason: not_http (no HTTP/1.x status line: TLS, another protocol), "
                                  "header_too_long, no_body (ended before any body byte: the client left first, or an "
                                  "empty body), unseen (no egress program saw it leave)", labels=labels + ["reason"])
    interim = CounterMetricFamily("qosagent_latency_responses_interim", "Interim (1xx) responses passed over",
                                  labels=labels)
    framed = CounterMetricFamily("qosagent_latency_responses_framed", "Responses counted at their last byte by "
                                 "their framing (Content-Length, chunked, 204/304), not by the next request or the "
                                 "close", labels=labels)
    pipelined = CounterMetricFamily("qosagent_latency_requests_pipelined", "Request lines that arrived while a "
                                    "request still waited for its response (HTTP/1.1 pipelining; sockops mode)",
                                    labels=labels)
    conns = CounterMetricFamily("qosagent_latency_connections", "Server-side connections on watched ports tracked",
                                labels=labels)
    untracked = CounterMetricFamily("qosagent_latency_connections_untracked", "Server-side connections on watched "
                                    "ports not tracked: no room for their state (tracepoint mode: socket table full)",
                                    labels=labels)
    adopted = CounterMetricFamily("qosagent_latency_connections_adopted", "Tracked connections that were open "
                                  "before their port was watched (at start or a reload), observed from their next "
                                  "request", labels=labels)
    mux = CounterMetricFamily("qosagent_latency_connections_multiplexed", "Tracked connections on "
                              "latency.multiplexed_ports (their requests overlap by protocol: counted, not timed)",
                              labels=labels)
    overlapped = CounterMetricFamily("qosagent_latency_requests_overlapped", "Requests whose bytes arrived while the "
                                     "previous response was still being written (pipelining; tracepoint mode only): "
                                     "counted, not timed", labels=labels)
    lost = CounterMetricFamily("qosagent_latency_observations_lost", "Latency observations dropped because their "
                               "tenant had no slot in the kernel's arrays (never expected)", labels=labels)
    inflight = GaugeMetricFamily("qosagent_latency_requests_in_flight", "Requests started and not yet complete",
                                 labels=labels)
    for t in part.tenants.values():
        lv = [t.tenant, t.tier]
        for name in SIGNALS:
            total: Histogram = getattr(t, name)
            add_histogram(hists[name], lv, total, bounds)
            win: Histogram = getattr(t, f"{name}_window")
            fam = windows[name]
            for q in QUANTILES:
                v = win.quantile(q)
                if v is not None:
                    fam.samples.append(Sample(fam.name, {"tenant": t.tenant, "tier": t.tier, "quantile": str(q)}, v))
            fam.add_metric(lv, win.count, win.sum_ns / 1e9)
        judged = t.window(signal).quantile(quantile)
        if judged is not None:
            slo.add_metric(lv + [signal, str(quantile)], judged)
        requests.add_metric(lv, t.requests)
        unpaired.add_metric(lv + ["response_without_request"], t.unpaired_send)
        unpaired.add_metric(lv + ["closed_without_response"], t.unpaired_close)
        for reason in bm.NO_TTFT_REASONS:
            no_ttft.add_metric(lv + [reason], t.no_ttft.get(reason, 0))
        interim.add_metric(lv, t.interim)
        framed.add_metric(lv, t.framed)
        pipelined.add_metric(lv, t.pipelined)
        conns.add_metric(lv, t.connections)
        adopted.add_metric(lv, t.adopted)
        mux.add_metric(lv, t.multiplexed_connections)
        untracked.add_metric(lv, t.untracked)
        overlapped.add_metric(lv, t.overlapped)
        lost.add_metric(lv, t.lost)
        inflight.add_metric(lv, t.in_flight)
    yield from hists.values()
    yield from windows.values()
    yield from (slo, requests, unpaired, no_ttft, interim, framed, pipelined, conns, adopted, mux, untracked,
                overlapped, lost, inflight)
    if part.unobserved:
        unobserved = GaugeMetricFamily("qosagent_latency_connections_unobserved", "Watched-port connections open now "
                                       "that are not observed, by reason: awaiting_request (open before their port "
                                       "was watched, observed from their next request), not_hooked (no program sees "
                                       "their packets), no_room (the kernel's list of connections to adopt was full)",
                                       labels=["reason"])
        for reason, n in part.unobserved.items():
            unobserved.add_metric([reason], n)
        yield unobserved
    if part.runqueue is not None:
        rq = NativeHistogramMetricFamily("qosagent_latency_runqueue_seconds", "Time threads of the processes "
                                         "serving watched ports waited runnable for a CPU, since start")
        add_histogram(rq, [], part.runqueue, bounds)
        yield rq


def _quantiles(h: Histogram) -> dict[str, Any]:
    out: dict[str, Any] = {"count": h.count}
    for q in QUANTILES:
        out[f"p{round(q * 100)}"] = h.quantile(q)
    return out


def slo_state(judged: float | None, slo: float) -> str:
    if slo <= 0:
        return "-"
    if judged is None:
        return "no data"
    return "ok" if judged <= slo else "breach"


def _ttft_note(t: Any) -> str | None:
    """Why a tenant has no TTFT in its window while it has responses: the most frequent reason since start."""
    if t.ttft_window.count or not t.response_window.count or not t.no_ttft:
        return None
    reason = max(t.no_ttft, key=t.no_ttft.get)
    return f"unavailable: {reason}"


def status(part: LatencyPart | None, slo: dict[str, float], signal: str, quantile: float) -> dict[str, Any]:
    """Per tenant: counts, each signal's window quantiles, and the SLO judged as admission judges it (the `signal`'s
    `quantile` over the window against the tier's SLO)."""
    if part is None:
        return {}
    tenants = []
    for t in part.tenants.values():
        bound = slo.get(t.tenant, 0.0)
        judged = t.window(signal).quantile(quantile)
        row: dict[str, Any] = {
            "tenant": t.tenant, "tier": t.tier, "requests": t.requests, "rate_rps": round(t.rate_rps, 3),
            "in_flight": t.in_flight, "unpaired": t.unpaired, "overlapped": t.overlapped,
            "pipelined": t.pipelined, "connections": t.connections,
            "multiplexed_connections": t.multiplexed_connections, "untracked": t.untracked, "lost": t.lost,
            "adopted": t.adopted,
            "no_ttft": dict(t.no_ttft), "interim": t.interim, "framed": t.framed,
        }
        for name in SIGNALS:
            row[name] = _quantiles(getattr(t, f"{name}_window"))
            row[f"{name}_total"] = _quantiles(getattr(t, name))
        row["ttft_note"] = _ttft_note(t)
        # Body writes per response over the window: the first body write is the TTFT, each later one an inter-token
        # gap (a write is a token or a group of them, as the server flushes).
        tw = t.ttft_window.count
        row["body_writes_per_response"] = round((tw + t.inter_token_window.count) / tw, 2) if tw else None
        row.update({"slo_p99": bound or None, "slo_signal": signal, "slo_quantile": quantile,
                    "slo_latency": judged, "slo": slo_state(judged, bound)})
        tenants.append(row)
    out: dict[str, Any] = {"window_s": part.window_s, "tenants": tenants, "found_open": part.found_open,
                           "unobserved": dict(part.unobserved), "namespaces": [dict(n) for n in part.namespaces]}
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
             f"{'TENANT':<16} {'TIER':<8} {'REQUESTS':>9} {'TTFT P50':>9} {'P95':>8} {'P99':>8} "
             f"{'ITL P50':>8} {'P99':>8} {'RESP P50':>9} {'P99':>8}  SLO"]
    for t in st.get("tenants", []):
        f, i, r = t["ttft"], t["inter_token"], t["response"]
        slo = t["slo"]
        if t.get("slo_p99") is not None:
            slo = (f"{slo} (p{t['slo_quantile'] * 100:g} {t['slo_signal']} {_ms(t['slo_latency'])} "
                   f"<= {t['slo_p99'] * 1000:g}ms)")
        lines.append(f"{t['tenant']:<16} {t['tier']:<8} {t['requests']:>9} {_ms(f['p50']):>9} {_ms(f['p95']):>8} "
                     f"{_ms(f['p99']):>8} {_ms(i['p50']):>8} {_ms(i['p99']):>8} {_ms(r['p50']):>9} "
                     f"{_ms(r['p99']):>8}  {slo}")
        notes = []
        if t.get("ttft_note"):
            notes.append(f"TTFT {t['ttft_note']}")
        if t.get("unpaired"):
            notes.append(f"{t['unpaired']} unpaired")
        if t.get("overlapped"):
            notes.append(f"{t['overlapped']} overlapped requests not timed")
        if t.get("multiplexed_connections"):
            notes.append(f"{t['multiplexed_connections']} multiplexed connections not timed")
        if notes:
            lines.append(f"{'':<16} ({', '.join(notes)})")
    waiting = {r: n for r, n in (st.get("unobserved") or {}).items() if n}
    if st.get("found_open") or waiting:
        adopted = sum(t.get("adopted", 0) for t in st.get("tenants", []))
        lines.append(f"connections open before their port was watched: {st.get('found_open', 0)} found, {adopted} "
                     "observed since their next request; not observed now: "
                     + (", ".join(f"{n} {r}" for r, n in sorted(waiting.items())) or "none"))
    for n in st.get("namespaces") or []:
        who = ", ".join(f"port {p}: {t}" for p, t in n["tenants"].items())
        shared = f"; shared with another namespace, unmatched: {', '.join(n['shared'])}" if n.get("shared") else ""
        pod = f", pod {n['pod']}" if n.get("pod") else ""
        addrs = ", ".join(n["addresses"]) or "none"
        lines.append(f"netns {n['netns']} (pid {n['pid']}{pod}) by address {addrs}{shared}: {who}")
    rq = st.get("runqueue")
    if rq:
        lines.append(f"run-queue latency of serving processes: p50 {_ms(rq['p50'])}  p95 {_ms(rq['p95'])}  "
                     f"p99 {_ms(rq['p99'])} ms ({rq['count']} waits)")
    return "\n".join(lines)
