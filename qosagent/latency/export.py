"""The latency part of a Snapshot as Prometheus families, as status JSON, and as the human table.

All three read the same LatencyPart, so a scrape and `qosagent status` taken on one tick agree.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable, Iterator, Mapping, Sequence

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from qosagent import exposition
from qosagent.capability import Attention
from qosagent.config import UNMATCHED
from qosagent.exposition import Family, NativeHistogramMetricFamily, Series, one
from qosagent.hist import Histogram, export_bounds_ns
from qosagent.latency import bpfmaps as bm
from qosagent.latency.config import ClassicBucketsConfig
from qosagent.latency.model import SHARED_TIER, LatencyPart, TenantLatency
from qosagent.retention import EVERYONE

QUANTILES = (0.5, 0.95, 0.99)
LO_LOG2, HI_LOG2 = 17, 37  # classic edges from 131 us to 137 s
DEFAULT_BUCKETS = ClassicBucketsConfig()


def le_text(ns: int) -> str:
    """A bucket edge in seconds, written exactly (ns are integers; no float rounding in `le`)."""
    whole, frac = divmod(ns, 10**9)
    return f"{whole}.{frac:09d}".rstrip("0").rstrip(".") if frac else f"{whole}.0"


@functools.lru_cache(maxsize=8)
def classic_bounds_ns(cfg: ClassicBucketsConfig = DEFAULT_BUCKETS, tier: bool = False) -> tuple[int, ...]:
    """The classic `le` edges (ns) of latency.classic_buckets: per_octave per power of two, fine_per_octave (a
    tenant's histograms) or tier_fine_per_octave (`tier`: the per-tier ones and the run queue's) over the powers of
    two that fine_from..fine_to touch. Every edge is an exact internal bucket edge."""
    lo = min(max(math.floor(math.log2(cfg.fine_from * 1e9)), LO_LOG2), HI_LOG2)
    hi = min(max(math.ceil(math.log2(cfg.fine_to * 1e9)), lo), HI_LOG2)
    fine = cfg.tier_fine_per_octave if tier else cfg.fine_per_octave
    return tuple(export_bounds_ns(LO_LOG2, HI_LOG2, cfg.per_octave, (lo, hi, fine)))


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


def add_histogram(fam: NativeHistogramMetricFamily, lv: Sequence[str], h: Histogram,
                  bounds_ns: tuple[int, ...]) -> None:
    """One series of a latency histogram: classic buckets at bounds_ns and, for protobuf scrapers, the native
    histogram. Every latency histogram family is filled through here."""
    cum = h.cumulative(list(bounds_ns))
    buckets = [(le_text(b), float(c)) for b, c in zip(bounds_ns, cum)] + [("+Inf", float(h.count))]
    fam.add_metric(list(lv), buckets, h.sum_ns / 1e9)
    fam.add_native(list(lv), h)


@dataclass(frozen=True)
class Source:
    """What the latency families are read from: the part, the SLO as admission judges it, the classic edges (a
    tenant's, and the tiers' and the run queue's), which tenants' series to write and whether to sum per tier."""

    part: LatencyPart
    signal: str
    quantile: float
    bounds: tuple[int, ...]
    tier_bounds: tuple[int, ...]
    shown: Container[str] = EVERYONE
    tier_histograms: bool = True
    _tiers: dict[str, Mapping[str, Histogram]] = field(default_factory=dict, compare=False)

    @functools.cached_property
    def rows(self) -> tuple[TenantLatency, ...]:
        """The tenants whose series are written (metrics.retention), and the unmatched one's always (one row, as
        quota's)."""
        return tuple(t for t in self.part.tenants.values() if t.tenant in self.shown or t.tenant == UNMATCHED)

    def tiers(self, signal: str) -> Mapping[str, Histogram]:
        """The signal's histogram since start summed over every tenant of each tier, idle ones included: a sum
        over the shown ones alone would go down when one is left out, which reads as a counter reset."""
        if signal not in self._tiers:
            acc: dict[str, tuple[dict[int, int], list[int]]] = {}
            for t in self.part.tenants.values():
                counts, total = acc.setdefault(t.tier, ({}, [0]))
                h = getattr(t, signal)
                for i, c in h.counts.items():
                    counts[i] = counts.get(i, 0) + c
                total[0] += h.sum_ns
            self._tiers[signal] = {tier: Histogram(c, total[0]) for tier, (c, total) in sorted(acc.items())}
        return self._tiers[signal]


def _add_histogram(fam: Metric, lv: Sequence[str], value: tuple[Histogram, tuple[int, ...]]) -> None:
    add_histogram(fam, lv, *value)  # type: ignore[arg-type]


def _add_window(fam: Metric, lv: Sequence[str], win: Histogram) -> None:
    """A window as a summary: its quantiles (absent while it is empty), count and sum."""
    for q in QUANTILES:
        v = win.quantile(q)
        if v is not None:
            fam.samples.append(Sample(fam.name, {"tenant": lv[0], "tier": lv[1], "quantile": str(q)}, v))
    fam.add_metric(lv, win.count, win.sum_ns / 1e9)  # type: ignore[attr-defined]


LABELS = ("tenant", "tier")


def _tenants(value: Callable[[Any], Any]) -> Callable[[Source], Series]:
    """A family with one series per tenant shown: value(TenantLatency)."""
    return lambda s: (([t.tenant, t.tier], value(t)) for t in s.rows)


def _tiered(s: Source) -> bool:
    return s.tier_histograms


def _signal(name: str, help_: str) -> tuple[Family[Source], Family[Source], Family[Source]]:
    """A signal's three families: its histogram since start, its window as a summary, and its histogram summed per
    tier (latency.tier_histograms)."""
    return (Family(f"qosagent_latency_{name}_seconds", "histogram", f"{help_}, since start", LABELS,
                   lambda s: (([t.tenant, t.tier], (getattr(t, name), s.bounds)) for t in s.rows),
                   add=_add_histogram, old=f"qosagent_{name}_seconds"),
            Family(f"qosagent_latency_{name}_window_seconds", "summary", f"{help_}, over the last latency.window: "
                   "quantiles (absent while the window is empty), count and sum", LABELS,
                   _tenants(lambda t: getattr(t, f"{name}_window")), add=_add_window,
                   old=f"qosagent_{name}_window_seconds"),
            Family(f"qosagent_latency_tier_{name}_seconds", "histogram", f"{help_}, since start, summed over the "
                   "tier's tenants (latency.tier_histograms; finer classic buckets than a tenant's)", ("tier",),
                   lambda s: (([tier], (h, s.tier_bounds)) for tier, h in s.tiers(name).items()),
                   shown=_tiered, add=_add_histogram))


def _counter(name: str, help_: str, value: Callable[[Any], Any]) -> Family[Source]:
    """A per-tenant count, renamed in 0.2.0 from qosagent_<name>."""
    return Family(f"qosagent_latency_{name}", "counter", help_, LABELS, _tenants(value), old=f"qosagent_{name}")


def _slo(s: Source) -> Series:
    verdict = s.part.judged(s.signal, s.quantile).tenants
    for t in s.rows:
        judged = verdict[t.tenant].latency
        if judged is not None:
            yield [t.tenant, t.tier, s.signal, str(s.quantile)], judged


def _by_reason(s: Source) -> Series:
    for t in s.rows:
        yield [t.tenant, t.tier, "response_without_request"], t.unpaired_send
        yield [t.tenant, t.tier, "closed_without_response"], t.unpaired_close


def _no_ttft(s: Source) -> Series:
    return (([t.tenant, t.tier, reason], t.no_ttft.get(reason, 0)) for t in s.rows
            for reason in bm.NO_TTFT_REASONS)


_SIGNALS = [_signal(name, help_) for name, help_ in SIGNALS.items()]

# Every serving process's waits for a CPU, a series per tier (its deprecated copy is RUNQ_OLD, below).
RUNQ: Family[Source] = Family(
    "qosagent_latency_runqueue_seconds", "histogram", "Time threads of the processes serving watched ports waited "
    "runnable for a CPU, since start, by the tier the process serves (tier=\"" + SHARED_TIER + "\": processes "
    "serving several tiers, never counted as one tier's); every process counts in one series, so their sum without "
    "tier is every serving process's", ("tier",),
    lambda s: (([tier], (h, s.tier_bounds)) for tier, h in s.part.runqueue_tiers.items()),
    shown=lambda s: s.part.runqueue is not None, add=_add_histogram)

# In the order a scrape writes them; `old`: the name before the families were grouped under qosagent_latency_
# (0.2.0), kept as a deprecated copy (exposition.with_deprecated).
FAMILIES: tuple[Family[Source], ...] = (
    *(hist for hist, _, _ in _SIGNALS),
    *(win for _, win, _ in _SIGNALS),
    *(tier for _, _, tier in _SIGNALS),
    Family("qosagent_latency_slo_seconds", "gauge", "The latency the SLO is judged on, as admission judges it: "
           "admission.quantile of admission.signal over the last latency.window (absent while the window is empty)",
           (*LABELS, "signal", "slo_quantile"), _slo, old="qosagent_slo_latency_seconds"),
    _counter("requests", "Requests whose response completed", lambda t: t.requests),
    Family("qosagent_latency_requests_unpaired", "counter", "Reads and writes that could not be paired: "
           "response_without_request (server wrote first), closed_without_response", (*LABELS, "reason"),
           _by_reason, old="qosagent_requests_unpaired"),
    Family("qosagent_latency_responses_without_ttft", "counter", "Responses with no time to first token, by "
           "reason: not_http (no HTTP/1.x status line: TLS, another protocol), header_too_long, no_body (ended "
           "before any body byte: the client left first, or an empty body), unseen (no egress program saw it "
           "leave)", (*LABELS, "reason"), _no_ttft, old="qosagent_responses_without_ttft"),
    _counter("responses_interim", "Interim (1xx) responses passed over", lambda t: t.interim),
    _counter("responses_framed", "Responses counted at their last byte by their framing (Content-Length, chunked, "
             "204/304), not by the next request or the close", lambda t: t.framed),
    _counter("requests_pipelined", "Request lines that arrived while a request still waited for its response "
             "(HTTP/1.1 pipelining; sockops mode)", lambda t: t.pipelined),
    _counter("connections", "Server-side connections on watched ports tracked", lambda t: t.connections),
    _counter("connections_adopted", "Tracked connections that were open before their port was watched (at start "
             "or a reload), observed from their next request", lambda t: t.adopted),
    _counter("connections_multiplexed", "Tracked connections on latency.multiplexed_ports (their requests overlap "
             "by protocol: counted, not timed)", lambda t: t.multiplexed_connections),
    _counter("connections_untracked", "Server-side connections on watched ports not tracked: no room for their "
             "state (tracepoint mode: socket table full)", lambda t: t.untracked),
    _counter("requests_overlapped", "Requests whose bytes arrived while the previous response was still being "
             "written (pipelining; tracepoint mode only): counted, not timed", lambda t: t.overlapped),
    Family("qosagent_latency_observations_lost", "counter", "Latency observations dropped because their tenant had "
           "no slot in the kernel's arrays (never expected)", LABELS, _tenants(lambda t: t.lost)),
    Family("qosagent_latency_egress_unread_packets", "counter", "sockops mode: packets the egress learner on the "
           "cgroup2 root could not hand to lat_egress (its tail-call slot empty or wrong): responses among them went "
           "unread, their time to first token lost (never expected)", (),
           one(lambda s: s.part.hooks.egress_unread), shown=lambda s: s.part.hooks.mode == "sockops"),
    Family("qosagent_latency_requests_in_flight", "gauge", "Requests started and not yet complete", LABELS,
           _tenants(lambda t: t.in_flight), old="qosagent_requests_in_flight"),
    Family("qosagent_latency_connections_unobserved", "gauge", "Watched-port connections open now that are not "
           "observed, by reason: awaiting_request (open before their port was watched, observed from their next "
           "request), not_hooked (no program sees their packets), no_room (the kernel's list of connections to "
           "adopt was full)", ("reason",), lambda s: (([r], n) for r, n in s.part.unobserved.items()),
           shown=lambda s: bool(s.part.unobserved), old="qosagent_connections_unobserved"),
    RUNQ,
)
# The run-queue family's name before 0.2.0 was one series without labels, every serving process's: its deprecated
# copy stays that series (the total over the tiers' rows), not a renamed copy of the tiers' series, which would
# change what rules and dashboards over the old name compute.
RUNQ_OLD: Family[Source] = Family(
    "qosagent_runqueue_latency_seconds", "histogram",
    f"Deprecated: the name of {RUNQ.name} before 0.2.0, removed in {exposition.DEPRECATED_NAMES_REMOVED_IN} "
    "(metrics.deprecated_names: false drops it now), as it was: one series, every serving process's (the sum of "
    f"{RUNQ.name} without tier). Time threads of the processes serving watched ports waited runnable for a CPU, "
    "since start", (), lambda s: (((), (s.part.runqueue, s.tier_bounds)),), add=_add_histogram)
ATTACHED: Family[int] = Family("qosagent_latency_programs_attached", "gauge", "Latency BPF programs attached to "
                               "their hooks", (), one(lambda n: n))
RENAMED = exposition.renamed(FAMILIES)


def with_deprecated(fams: Iterable[Metric]) -> Iterator[Metric]:
    return exposition.with_deprecated(fams, RENAMED, "before 0.2.0")


def families(part: LatencyPart | None, programs_attached: int, signal: str, quantile: float,
             classic_buckets: ClassicBucketsConfig = DEFAULT_BUCKETS, shown: Container[str] = EVERYONE,
             tier_histograms: bool = True, deprecated: bool = False) -> Iterable[Metric]:
    """The latency families; per-tenant series of the tenants in `shown` (metrics.retention); with `deprecated`
    (metrics.deprecated_names) each renamed one followed by its copy under its old name."""
    yield ATTACHED.build(programs_attached)
    if part is None:
        return
    source = Source(part, signal, quantile, classic_bounds_ns(classic_buckets),
                    classic_bounds_ns(classic_buckets, tier=True), shown, tier_histograms)
    fams = exposition.families(FAMILIES, source)
    if not deprecated:
        yield from fams
        return
    for fam in with_deprecated(fams):
        yield fam
        if fam.name == RUNQ.name:
            yield RUNQ_OLD.build(source)


def traffic(part: LatencyPart) -> dict[str, tuple[int, ...]]:
    """Per tenant, counts that move with its traffic: requests completed, connections, reads and writes not paired
    or overlapped, requests in flight, and the sum of the gaps between body writes (a long stream's tokens keep its
    tenant active)."""
    return {t.tenant: (t.requests, t.connections, t.unpaired, t.overlapped, t.in_flight, t.inter_token.sum_ns)
            for t in part.tenants.values()}


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
    `quantile` over the window against the tier's SLO); the hooks as the tick found them."""
    if part is None:
        return {}
    tenants = []
    verdict = part.judged(signal, quantile).tenants
    for t in part.tenants.values():
        bound = slo.get(t.tenant, 0.0)
        judged = verdict[t.tenant].latency
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
        out["runqueue_tiers"] = {tier: _quantiles(h) for tier, h in part.runqueue_tiers_window.items()}
        out["runqueue_tiers_total"] = {tier: _quantiles(h) for tier, h in part.runqueue_tiers.items()}
    h = part.hooks
    out["mode"] = h.mode
    out["ttft"] = h.ttft
    out["programs"] = [{"name": n, "id": i} for n, i in h.programs]
    if h.mode == "sockops":
        out["cgroups"] = list(h.cgroups)
        out["learning"] = h.learning
        out["cgroup_errors"] = h.cgroup_errors
        out["egress_unread"] = h.egress_unread
    return out


def attention(st: dict[str, Any]) -> dict[str, Attention]:
    """Per tenant: in breach of its SLO as admission judges it, and its completed requests per second."""
    return {t["tenant"]: Attention(breaching=t.get("slo") == "breach", rps=t.get("rate_rps") or 0.0)
            for t in st.get("tenants", [])}


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
        for tier, t in (st.get("runqueue_tiers") or {}).items():
            who = "serving several tiers" if tier == SHARED_TIER else f"tier {tier}"
            lines.append(f"  {who:<22} p50 {_ms(t['p50'])}  p95 {_ms(t['p95'])}  p99 {_ms(t['p99'])} ms "
                         f"({t['count']} waits)")
    return "\n".join(lines)
