"""Prometheus exposition built at scrape time from the latest Snapshot (a custom collector), plus health routes.

No gauge is mutated from the loop: a scrape reads one Snapshot, so every series in it describes the same tick.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from qosagent import exposition, weblisten
from qosagent.capability import State
from qosagent.config import MetricsBasicAuth, MetricsConfig, MetricsTls
from qosagent.readiness import readiness
from qosagent.weblisten import Listener, Reply, Route, Security

if TYPE_CHECKING:
    from qosagent.daemon import Agent

log = logging.getLogger("qosagent.metrics")


class AgentCollector:
    def __init__(self, agent: "Agent"):
        self.agent = agent

    def collect(self) -> Iterable[Metric]:
        a = self.agent
        snap = a.latest
        state = GaugeMetricFamily("qosagent_capability_state", "1 for the state each capability is in",
                                  labels=["capability", "state"])
        for name, verdict in a.verdicts.items():
            for s in State:
                state.add_metric([name, s.value], 1.0 if verdict.state is s else 0.0)
        yield state
        yield CounterMetricFamily("qosagent_ticks", "Control-loop ticks run", value=a.stats.ticks)
        yield GaugeMetricFamily("qosagent_tick_duration_seconds", "Duration of the last tick",
                                value=a.stats.tick_seconds_last)
        yield GaugeMetricFamily("qosagent_tick_duration_max_seconds", "Longest tick since start",
                                value=a.stats.tick_seconds_max)
        yield CounterMetricFamily("qosagent_tick_overruns", "Ticks that started late because one ran over interval",
                                  value=a.stats.tick_overruns)
        errors = CounterMetricFamily("qosagent_collect_errors", "Failed reads of a capability's sources (maps, "
                                     "sysfs, NVML) by capability", labels=["capability"])
        for name, n in sorted(a.stats.collect_errors.items()):
            errors.add_metric([name], n)
        yield errors
        apply_errors = CounterMetricFamily("qosagent_apply_errors", "Failed decisions or writes of a capability "
                                           "(maps, sysfs, NVML, affinity) by capability", labels=["capability"])
        for name, n in sorted(a.stats.apply_errors.items()):
            apply_errors.add_metric([name], n)
        yield apply_errors
        reloads = CounterMetricFamily("qosagent_config_reloads", "Config reloads by result", labels=["result"])
        reloads.add_metric(["ok"], a.stats.reloads_ok)
        reloads.add_metric(["failed"], a.stats.reloads_failed)
        yield reloads
        # The SLOs beside the measured quantiles, so dashboards and alerts compare without copying the config.
        slo = GaugeMetricFamily("qosagent_tier_slo_p99_seconds", "The tier's p99 response-time SLO (tiers.<name>"
                                ".slo_p99)", labels=["tier"])
        for tier, tc in sorted(a.config.tiers.items()):
            slo.add_metric([tier], tc.slo_p99)
        yield slo
        gpu = snap.part("gpu")
        available = GaugeMetricFamily("qosagent_gpu_data_available", "1 when GPU readings are known this tick; "
                                      "reason: ok, or why not (unavailable: no NVML library or driver, "
                                      "no_permission, gpu_lost, disabled, sample_failed, failed)", labels=["reason"])
        if gpu is not None and gpu.available:
            available.add_metric(["ok"], 1.0)
        else:
            available.add_metric([(gpu.cause or "failed") if gpu is not None else "starting"], 0.0)
        yield available
        if gpu is not None and gpu.available:
            # The readings admission sheds on (memory) and placement follows (processes), so a dashboard shows the
            # input beside the decision; dvfs exports its own (temperature, power, clocks).
            used = GaugeMetricFamily("qosagent_gpu_memory_used_bytes", "GPU memory in use, the driver's "
                                     "reservation included (NVML)", labels=["gpu"])
            total = GaugeMetricFamily("qosagent_gpu_memory_total_bytes", "GPU memory size (NVML)", labels=["gpu"])
            util = GaugeMetricFamily("qosagent_gpu_utilization_ratio", "Share of the last sample period a kernel "
                                     "ran on the GPU (NVML)", labels=["gpu"])
            for g in gpu.gpus:
                if g.lost:
                    continue
                if g.memory_used is not None:
                    used.add_metric([str(g.index)], g.memory_used)
                if g.memory_total is not None:
                    total.add_metric([str(g.index)], g.memory_total)
                if g.utilization_pct is not None:
                    util.add_metric([str(g.index)], g.utilization_pct / 100)
            yield used
            yield total
            yield util
        for svc in a.services:
            try:
                yield from svc.metrics(snap.part(svc.name), a.config)
            except Exception:  # noqa: BLE001 - as a capability's below
                log.exception("%s: metrics failed", svc.name)
        for cap in a.capabilities:
            try:
                yield from cap.metrics(snap)
            except Exception:  # noqa: BLE001 - one broken capability must not empty the scrape
                log.exception("%s: metrics failed", cap.name)


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
        registry = make_registry(agent)

        def metrics(headers: Mapping[str, str]) -> Reply:
            return (200, *scrape_body(registry, headers.get("Accept")))

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


def scrape_body(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The exposition a scraper asked for: protobuf (native histograms) when its Accept header ranks it first,
    else text. A protobuf encoding that fails is logged and answered in text: the scrape goes on."""
    if exposition.wants_protobuf(accept):
        try:
            return exposition.encode(registry.collect()), exposition.CONTENT_TYPE
        except Exception:  # noqa: BLE001 - a bug in the encoder must not cost the scrape
            log.exception("protobuf exposition failed; answering in text")
    return generate_latest(registry), CONTENT_TYPE_LATEST


def agent_health(agent: "Agent") -> tuple[bool, str]:
    """Healthy while the loop ticks: the last tick is at most 5 intervals (and 2 s) old. Not before the first tick:
    a start that hangs (compiling, attaching) must fail the startup probe, which is what bounds it."""
    import time

    if not agent.ready.is_set():
        return False, "starting"
    age = time.monotonic() - agent.latest.monotonic
    limit = max(5 * agent.config.interval, 2.0)
    if age > limit:
        return False, f"last tick {age:.1f}s ago"
    return True, "ok"
