"""Prometheus' protobuf exposition (delimited io.prometheus.client.MetricFamily messages), written by hand, and the
choice between it and the text format from a scraper's Accept header.

prometheus_client writes only text, and text cannot carry native histograms; a scraper with native histograms on
(Prometheus >= 2.40 with --enable-feature=native-histograms) asks for protobuf first. The wire format needs five
things: varints, zigzag varints, little-endian doubles, length-delimited fields and packed repeated fields, so a
dependency on the protobuf package (and a generated descriptor to keep in step with it) buys nothing here. Field
numbers are those of io/prometheus/client/metrics.proto.

Every family the text format carries is written (the same names: counters get `_total`), histograms with their
classic buckets and, where a NativeHistogramMetricFamily has one for the series, the native histogram beside them.
"""

from __future__ import annotations

import copy
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Iterator, Mapping, Sequence, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from qosagent.nativehist import Native, native

if TYPE_CHECKING:
    from qosagent.hist import Histogram

# The message is named in full, as Prometheus asks for it (and client_golang answers); the bare package name is
# accepted in an Accept header too.
CONTENT_TYPE = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
_MEDIA_TYPE = "application/vnd.google.protobuf"
_PROTOS = ("io.prometheus.client.MetricFamily", "io.prometheus.client")

# MetricType
COUNTER, GAUGE, SUMMARY, UNTYPED, HISTOGRAM = 0, 1, 2, 3, 4
# Wire types
_VARINT, _I64, _LEN = 0, 1, 2


class NativeHistogramMetricFamily(HistogramMetricFamily):
    """A histogram family whose series also carry the internal histogram they were made from, so the protobuf
    exposition can write each one's native histogram (worked out only then: a text scrape does not pay for it)."""

    def __init__(self, name: str, documentation: str, labels: list[str] | None = None, unit: str = ""):
        super().__init__(name, documentation, labels=labels, unit=unit)
        self.labelnames = tuple(labels or ())
        self.native: dict[tuple[tuple[str, str], ...], "Histogram"] = {}

    def add_native(self, label_values: list[str], h: "Histogram") -> None:
        self.native[tuple(sorted(zip(self.labelnames, label_values)))] = h


# ---- content negotiation ------------------------------------------------------------------------------------------
def wants_protobuf(accept: str | None) -> bool:
    """True when the Accept header ranks the delimited io.prometheus.client protobuf at least as high as anything
    text we could serve instead. Anything odd (no header, garbage, q=0, other protobuf messages) gets text."""
    best_proto = best_text = 0.0
    for item in (accept or "").split(","):
        parts = [p.strip() for p in item.split(";")]
        media = parts[0].lower()
        params: dict[str, str] = {}
        for p in parts[1:]:
            k, sep, v = p.partition("=")
            if sep:
                params[k.strip().lower()] = v.strip().strip('"')
        try:
            q = float(params.get("q", "1"))
        except ValueError:
            continue
        if not 0.0 <= q <= 1.0:
            continue
        if media == _MEDIA_TYPE:
            if params.get("proto") in _PROTOS and params.get("encoding") == "delimited":
                best_proto = max(best_proto, q)
        elif media in ("text/plain", "text/*", "*/*"):
            best_text = max(best_text, q)
    return best_proto > 0 and best_proto >= best_text


# ---- wire format -------------------------------------------------------------------------------------------------
def varint(n: int) -> bytes:
    """Base-128 varint of an unsigned value (a negative int64 as its two's complement, ten bytes)."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63) if n < 0 else n << 1


def _tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def _uint(field: int, n: int) -> bytes:
    return _tag(field, _VARINT) + varint(n)


def _sint(field: int, n: int) -> bytes:
    return _tag(field, _VARINT) + varint(zigzag(n))


def _double(field: int, v: float) -> bytes:
    return _tag(field, _I64) + struct.pack("<d", v)


def _bytes(field: int, payload: bytes) -> bytes:
    return _tag(field, _LEN) + varint(len(payload)) + payload


def _str(field: int, s: str) -> bytes:
    return _bytes(field, s.encode("utf-8"))


def _packed_sint(field: int, values: Iterable[int]) -> bytes:
    return _bytes(field, b"".join(varint(zigzag(v)) for v in values))


# ---- messages ----------------------------------------------------------------------------------------------------
def _labels(labels: dict[str, str]) -> bytes:
    return b"".join(_bytes(1, _str(1, k) + _str(2, v)) for k, v in sorted(labels.items()))  # Metric.label


def _native(n: Native) -> bytes:
    out = _sint(5, n.schema) + _double(6, n.zero_threshold) + _uint(7, n.zero_count)
    out += b"".join(_bytes(12, _sint(1, off) + _uint(2, length)) for off, length in n.spans)  # positive_span
    if n.deltas:
        out += _packed_sint(13, n.deltas)  # positive_delta
    return out


def _family(name: str, help_: str, mtype: int, metrics: list[bytes]) -> bytes:
    if not metrics:  # text writes HELP and TYPE alone; a scraper learns nothing from either
        return b""
    body = _str(1, name) + _str(2, help_) + _uint(3, mtype) + b"".join(_bytes(4, m) for m in metrics)
    return varint(len(body)) + body  # delimited: each message preceded by its length


def _group(samples: Iterable, drop: str) -> dict[tuple[tuple[str, str], ...], list]:
    """Samples by their labels without `drop` (le, quantile), in order of first appearance."""
    out: dict[tuple[tuple[str, str], ...], list] = {}
    for s in samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != drop))
        out.setdefault(key, []).append(s)
    return out


def _histogram(m: Metric) -> list[bytes]:
    natives = getattr(m, "native", {})
    out = []
    for key, samples in _group(m.samples, "le").items():
        count, total, buckets = 0, 0.0, b""
        for s in samples:
            if s.name == m.name + "_bucket":
                le = float(s.labels["le"])
                if le != float("inf"):  # implied by the count, as client libraries write it
                    buckets += _bytes(3, _uint(1, int(s.value)) + _double(2, le))
            elif s.name == m.name + "_count":
                count = int(s.value)
            elif s.name == m.name + "_sum":
                total = s.value
        h = _uint(1, count) + _double(2, total) + buckets
        if key in natives:
            h += _native(native(natives[key]))
        out.append(_labels(dict(key)) + _bytes(7, h))
    return out


def _summary(m: Metric) -> list[bytes]:
    out = []
    for key, samples in _group(m.samples, "quantile").items():
        count, total, quantiles = 0, 0.0, b""
        for s in samples:
            if s.name == m.name and "quantile" in s.labels:
                quantiles += _bytes(3, _double(1, float(s.labels["quantile"])) + _double(2, s.value))
            elif s.name == m.name + "_count":
                count = int(s.value)
            elif s.name == m.name + "_sum":
                total = s.value
        out.append(_labels(dict(key)) + _bytes(4, _uint(1, count) + _double(2, total) + quantiles))
    return out


def _family_of(m: Metric) -> Iterable[bytes]:
    """One metric as the families the text format would write for it."""
    # Samples the text format moves out into gauges of their own (created timestamps and the like).
    extra = {m.name + sfx: [] for sfx in ("_created", "_gsum", "_gcount")}
    samples = []
    for s in m.samples:
        (extra[s.name] if s.name in extra else samples).append(s)
    if m.type == "counter":
        yield _family(m.name + "_total", m.documentation, COUNTER,
                      [_labels(s.labels) + _bytes(3, _double(1, s.value)) for s in samples])
    elif m.type in ("gauge", "info", "stateset"):
        name = m.name + "_info" if m.type == "info" else m.name
        yield _family(name, m.documentation, GAUGE, [_labels(s.labels) + _bytes(2, _double(1, s.value))
                                                     for s in samples])
    elif m.type == "summary":
        yield _family(m.name, m.documentation, SUMMARY, _summary(m))
    elif m.type == "histogram":
        yield _family(m.name, m.documentation, HISTOGRAM, _histogram(m))
    else:  # unknown, gaugehistogram: every sample as it would read in text
        for name in dict.fromkeys(s.name for s in samples):
            yield _family(name, m.documentation, UNTYPED, [_labels(s.labels) + _bytes(5, _double(1, s.value))
                                                           for s in samples if s.name == name])
    for name, more in extra.items():
        if more:
            yield _family(name, m.documentation, GAUGE, [_labels(s.labels) + _bytes(2, _double(1, s.value))
                                                         for s in more])


def encode(metrics: Iterable[Metric]) -> bytes:
    """The delimited protobuf exposition of metrics (a registry's collect())."""
    return b"".join(f for m in metrics for f in _family_of(m))


# Families renamed in 0.2.0 are also exposed under their old names, as deprecated copies, while
# metrics.deprecated_names is on (off by default since issue 26: they doubled every latency family of every tenant).
DEPRECATED_NAMES_REMOVED_IN = "0.3.0"


def with_deprecated(fams: Iterable[Metric], renamed: Mapping[str, str], was: str) -> Iterator[Metric]:
    """Each family, followed by its copy under its old name (renamed: new -> old) where it has one: the same
    samples, its HELP saying which name replaces it (`was`: when the old one was its name) and when it goes."""
    for fam in fams:
        yield fam
        old = renamed.get(fam.name)
        if old is None:
            continue
        alias = copy.copy(fam)  # a native histogram's series come along (read-only)
        alias.name = old
        alias.documentation = (f"Deprecated: the name of {fam.name} {was}, removed in "
                               f"{DEPRECATED_NAMES_REMOVED_IN} (metrics.deprecated_names: false drops it now). "
                               f"{fam.documentation}")
        alias.samples = [s._replace(name=old + s.name[len(fam.name):]) for s in fam.samples]
        yield alias


# ---- families declared as data -----------------------------------------------------------------------------------
S = TypeVar("S")
Series = Iterable[tuple[Sequence[str], Any]]  # (label values, value) per series


def _always(_source: Any) -> bool:
    return True


def _add(fam: Metric, labels: Sequence[str], value: Any) -> None:
    fam.add_metric(labels, value)  # type: ignore[attr-defined]


_KINDS: dict[str, Callable[..., Metric]] = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                                            "summary": SummaryMetricFamily, "histogram": NativeHistogramMetricFamily}


@dataclass(frozen=True)
class Family(Generic[S]):
    """One metric family as a row of its capability's table: what a scrape says of it (name, type, help, labels),
    where its series come from (`series`, from the exporter's source: a part and what goes with it), whether it is
    written at all (`shown`: a family left out has no HELP or TYPE either), how one value becomes samples (`add`:
    add_metric, unless a histogram or summary needs more) and the name it had before a rename (`old`: exposed as a
    deprecated copy, with_deprecated, while metrics.deprecated_names is on)."""

    name: str
    type: str  # counter, gauge, summary or histogram (with native histograms for protobuf scrapers)
    help: str
    labels: tuple[str, ...]
    series: Callable[[S], Series]
    shown: Callable[[S], bool] = _always
    add: Callable[[Metric, Sequence[str], Any], None] = _add
    old: str = ""

    def build(self, source: S) -> Metric:
        fam = _KINDS[self.type](self.name, self.help, labels=list(self.labels))
        for labels, value in self.series(source):
            self.add(fam, labels, value)
        return fam


def families(table: Iterable[Family[S]], source: S) -> Iterator[Metric]:
    """The table's families, in its order, for one source: what every exporter is."""
    for f in table:
        if f.shown(source):
            yield f.build(source)


def renamed(table: Iterable[Family[Any]]) -> dict[str, str]:
    """new name -> old name of the table's renamed families (with_deprecated's `renamed`)."""
    return {f.name: f.old for f in table if f.old}


def one(value: Callable[[S], Any]) -> Callable[[S], Series]:
    """The series of a family without labels: one value."""
    return lambda source: (((), value(source)),)

