"""Prometheus exposition built from the latest Snapshot when it is first scraped (a custom collector), plus health
routes.

No gauge is mutated from the loop: a scrape reads one Snapshot, so every series in it describes the same tick; the
exposition of a snapshot is built once and encoded once per format, however many scrapes ask for it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from qosagent import exposition, weblisten
from qosagent.capability import State
from qosagent.config import MetricsBasicAuth, MetricsConfig, MetricsTls
from qosagent.exposition import Family, Series, one
from qosagent.gpu.backend import GPU
from qosagent.readiness import readiness
from qosagent.retention import Retention
from qosagent.snapshot import Snapshot
from qosagent.weblisten import Listener, Reply, Route, Security

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.daemon import Agent
    from qosagent.gpu.backend import GpuSample, GpuState

log = logging.getLogger("qosagent.metrics")


@dataclass(frozen=True)
class _Scrape:
    """What the agent's own families are read from: the agent (its verdicts, its counters, its config) and the one
    Snapshot this scrape reads."""

    agent: "Agent"
    snap: Snapshot

    @property
    def gpu(self) -> "GpuState | None":
        return self.snap.part(GPU)

    @property
    def gpus_known(self) -> bool:
        return self.gpu is not None and self.gpu.available


def _states(s: _Scrape) -> Series:
    return (([name, st.value], 1.0 if verdict.state is st else 0.0) for name, verdict in s.agent.verdicts.items()
            for st in State)


def _gpu_available(s: _Scrape) -> Series:
    gpu = s.gpu
    if gpu is not None and gpu.available:
        return [(["ok"], 1.0)]
    return [([(gpu.cause or "failed") if gpu is not None else "starting"], 0.0)]


def _gpus(value: Callable[["GpuSample"], float | None]) -> Callable[[_Scrape], Series]:
    """A series per GPU not lost whose reading is known."""
    def series(s: _Scrape) -> Series:
        assert s.gpu is not None
        return (([str(g.index)], v) for g in s.gpu.gpus if not g.lost and (v := value(g)) is not None)
    return series


def _gpus_known(s: _Scrape) -> bool:
    return s.gpus_known


FAMILIES: tuple[Family[_Scrape], ...] = (
    Family("qosagent_capability_state", "gauge", "1 for the state each capability is in", ("capability", "state"),
           _states),
    Family("qosagent_ticks", "counter", "Control-loop ticks run", (), one(lambda s: s.agent.stats.ticks)),
    Family("qosagent_tick_duration_seconds", "gauge", "Duration of the last tick", (),
           one(lambda s: s.agent.stats.tick_seconds_last)),
    Family("qosagent_tick_duration_max_seconds", "gauge", "Longest tick since start", (),
           one(lambda s: s.agent.stats.tick_seconds_max)),
    Family("qosagent_tick_overruns", "counter", "Ticks that started late because one ran over interval", (),
           one(lambda s: s.agent.stats.tick_overruns)),
    Family("qosagent_tick_resting", "gauge", "1 while the loop ticks every rest_interval, its ticks having found "
           "nothing new and left nothing pending; 0 while it ticks every interval", (),
           one(lambda s: int(s.agent.pace.resting))),
    Family("qosagent_collect_errors", "counter", "Failed reads of a capability's sources (maps, sysfs, NVML) by "
           "capability", ("capability",),
           lambda s: (([n], v) for n, v in sorted(s.agent.stats.collect_errors.items()))),
    Family("qosagent_apply_errors", "counter", "Failed decisions or writes of a capability (maps, sysfs, NVML, "
           "affinity) by capability", ("capability",),
           lambda s: (([n], v) for n, v in sorted(s.agent.stats.apply_errors.items()))),
    Family("qosagent_proc_unreadable", "counter", "Reads of other processes' /proc entries the kernel refused "
           "(not a process gone) by what: ns_net (their network namespace, which needs CAP_SYS_PTRACE), fd (their "
           "open sockets, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH); above 0, pods or servers go unseen",
           ("what",), lambda s: (([w], n) for w, n in sorted(s.agent.hostfs.unreadable.items()))),
    Family("qosagent_config_reloads", "counter", "Config reloads by result", ("result",),
           lambda s: ((["ok"], s.agent.stats.reloads_ok), (["failed"], s.agent.stats.reloads_failed))),
    # The SLOs beside the measured quantiles, so dashboards and alerts compare without copying the config.
    Family("qosagent_tier_slo_p99_seconds", "gauge", "The tier's p99 response-time SLO (tiers.<name>.slo_p99)",
           ("tier",), lambda s: (([tier], tc.slo_p99) for tier, tc in sorted(s.agent.config.tiers.items()))),
    Family("qosagent_gpu_data_available", "gauge", "1 when GPU readings are known this tick; reason: ok, or why not "
           "(unavailable: no NVML library or driver, no_permission, gpu_lost, disabled, sample_failed, failed)",
           ("reason",), _gpu_available),
    # The readings admission sheds on (memory) and placement follows (processes), so a dashboard shows the input
    # beside the decision; dvfs exports its own (temperature, power, clocks).
    Family("qosagent_gpu_memory_used_bytes", "gauge", "GPU memory in use, the driver's reservation included (NVML)",
           ("gpu",), _gpus(lambda g: g.memory_used), shown=_gpus_known),
    Family("qosagent_gpu_memory_total_bytes", "gauge", "GPU memory size (NVML)", ("gpu",),
           _gpus(lambda g: g.memory_total), shown=_gpus_known),
    Family("qosagent_gpu_utilization_ratio", "gauge", "Share of the last sample period a kernel ran on the GPU "
           "(NVML)", ("gpu",), _gpus(lambda g: None if g.utilization_pct is None else g.utilization_pct / 100),
           shown=_gpus_known),
)


class AgentCollector:
    """The agent's families, built once per snapshot (and config) and encoded once per format: every scrape of one
    tick is the same bytes, so a scrape costs one exposition a tick at most, however many scrapers ask. Per-tenant
    series are written for the tenants with traffic within metrics.retention (qosagent/retention.py)."""

    def __init__(self, agent: "Agent"):
        self.agent = agent
        self.retention = Retention(agent.config.metrics.retention)
        self._lock = threading.Lock()
        self._built_for: tuple[Snapshot, "Config"] | None = None
        self._metrics: list[Metric] = []
        self._bodies: dict[bool, bytes] = {}  # protobuf? -> the encoded exposition

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return list(self._current())

    def body(self, protobuf: bool) -> bytes:
        """The exposition of the latest snapshot, text or protobuf, encoded at most once per snapshot."""
        with self._lock:
            metrics = self._current()
            if protobuf not in self._bodies:
                self._bodies[protobuf] = exposition.encode(metrics) if protobuf else generate_latest(_Built(metrics))
            return self._bodies[protobuf]

    def _current(self) -> list[Metric]:
        a = self.agent
        snap, cfg = a.latest, a.config
        if self._built_for is None or self._built_for[0] is not snap or self._built_for[1] is not cfg:
            self._metrics = list(self._build(snap, cfg))
            self._bodies = {}
            self._built_for = (snap, cfg)
        return self._metrics

    def _build(self, snap: Snapshot, cfg: "Config") -> Iterator[Metric]:
        a = self.agent
        yield from exposition.families(FAMILIES, _Scrape(a, snap))
        for svc in a.services:
            try:
                yield from svc.metrics(snap.part(svc.name), cfg)
            except Exception:  # noqa: BLE001 - as a capability's below
                log.exception("%s: metrics failed", svc.name)
        self.retention.window = cfg.metrics.retention
        traffic = {}
        for cap in a.capabilities:
            try:
                traffic[cap.name] = cap.traffic(snap)
            except Exception:  # noqa: BLE001 - its tenants are then judged by the others' traffic
                log.exception("%s: traffic failed", cap.name)
        shown = self.retention.shown(snap.monotonic, traffic)
        for cap in a.capabilities:
            try:
                yield from cap.metrics(snap, shown)
            except Exception:  # noqa: BLE001 - one broken capability must not empty the scrape
                log.exception("%s: metrics failed", cap.name)


@dataclass(frozen=True)
class _Built:
    """Families already built, as generate_latest reads a registry."""

    metrics: list[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def make_registry(agent: "Agent") -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))  # type: ignore[arg-type]
    return reg


class MetricsServer(Listener):
    """/metrics, /healthz (the loop is ticking; not while starting, so a start that hangs fails a startup probe)
    and /readyz (first tick done, every enabled capability active, idle or optional: readiness.readiness()).
    Basic auth guards /metrics only: kubelet probes and load balancers reach the health routes without it."""

    def __init__(self, agent: "Agent", listen: str, tls: MetricsTls | None = None,
                 basic_auth: MetricsBasicAuth | None = None, sec: Security | None = None):
        """sec (from weblisten.security) or else tls and basic_auth say what clients must show. Raises OSError
        (with the offending file named) when the listener, certificate or password is unusable."""
        if sec is None:
            sec = weblisten.security(MetricsConfig(listen=listen, tls=tls, basic_auth=basic_auth))
        collector = AgentCollector(agent)

        def metrics(headers: Mapping[str, str]) -> Reply:
            return (200, *scrape_body(collector, headers.get("Accept")))

        super().__init__(listen, {"/metrics": metrics, **health_routes(agent)}, sec, frozenset({"/metrics"}),
                         name="metrics")


def health_routes(agent: "Agent") -> dict[str, Route]:
    def answer(check: Callable[["Agent"], tuple[bool, str]]) -> Route:
        def route(_headers: Mapping[str, str]) -> Reply:
            ok, why = check(agent)
            return 200 if ok else 503, (why + "\n").encode(), "text/plain"
        return route

    return {"/healthz": answer(agent_health), "/readyz": answer(readiness)}


def health_server(agent: "Agent", listen: str) -> Listener:
    """/healthz and /readyz alone, in plain HTTP (metrics.health_listen): probes keep working when /metrics asks
    for TLS, client certificates or credentials, and tell nothing but health."""
    return Listener(listen, health_routes(agent), name="health")


def scrape_body(collector: AgentCollector, accept: str | None) -> tuple[bytes, str]:
    """The exposition a scraper asked for: protobuf (native histograms) when its Accept header ranks it first,
    else text. A protobuf encoding that fails is logged and answered in text: the scrape goes on."""
    if exposition.wants_protobuf(accept):
        try:
            return collector.body(protobuf=True), exposition.CONTENT_TYPE
        except Exception:  # noqa: BLE001 - a bug in the encoder must not cost the scrape
            log.exception("protobuf exposition failed; answering in text")
    return collector.body(protobuf=False), CONTENT_TYPE_LATEST


def agent_health(agent: "Agent") -> tuple[bool, str]:
    """Healthy while the loop ticks: the last tick is at most 5 of its periods (interval, or rest_interval while
    resting) old, and 2 s is always allowed. Not before the first tick: a start that hangs (compiling, attaching)
    must fail the startup probe, which is what bounds it."""
    import time

    if not agent.ready.is_set():
        return False, "starting"
    age = time.monotonic() - agent.latest.monotonic
    limit = max(5 * agent.pace.period, 2.0)
    if age > limit:
        return False, f"last tick {age:.1f}s ago"
    return True, "ok"
