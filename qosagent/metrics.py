"""Prometheus exposition built at scrape time from the latest Snapshot (a custom collector), plus health routes.

No gauge is mutated from the loop: a scrape reads one Snapshot, so every series in it describes the same tick.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from qosagent import exposition
from qosagent.capability import State
from qosagent.readiness import readiness

if TYPE_CHECKING:
    from qosagent.config import MetricsBasicAuth, MetricsTls
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


class MetricsServer:
    """/metrics, /healthz (the loop is ticking; not while starting, so a start that hangs fails a startup probe)
    and /readyz (first tick done, every enabled capability active or optional: readiness.readiness())."""

    def __init__(self, agent: "Agent", listen: str, tls: "MetricsTls | None" = None,
                 basic_auth: "MetricsBasicAuth | None" = None):
        """Raises OSError (with the offending file named) when the listener, certificate or password is unusable."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        registry = make_registry(agent)
        ssl_ctx = _tls_context(tls) if tls else None
        authorized = _basic_auth_checker(basic_auth) if basic_auth else None

        class Handler(BaseHTTPRequestHandler):
            # A client that stalls (or never finishes a TLS handshake) holds only its own thread, and not for long.
            timeout = 10

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    if authorized and not authorized(self.headers.get("Authorization", "")):
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", 'Basic realm="qosagent", charset="UTF-8"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self._send(200, *scrape_body(registry, self.headers.get("Accept")))
                elif path == "/healthz":
                    ok, why = agent_health(agent)
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain")
                elif path == "/readyz":
                    ok, why = readiness(agent)
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        family = __import__("socket").AF_INET6 if ":" in host else __import__("socket").AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

            def finish_request(self, request, client_address):  # type: ignore[no-untyped-def]
                if ssl_ctx is None:
                    return super().finish_request(request, client_address)
                # The handshake runs here, in the request's thread, so a slow client cannot stall accept().
                request.settimeout(Handler.timeout)
                with ssl_ctx.wrap_socket(request, server_side=True) as tls_sock:
                    super().finish_request(tls_sock, client_address)

            def handle_error(self, request, client_address):  # type: ignore[no-untyped-def]
                # Failed handshakes and dropped clients are the client's problem, not the agent's.
                log.debug("metrics request from %s failed", client_address, exc_info=True)

        self.httpd = Server((host, int(port)), Handler)
        self.address = self.httpd.server_address
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


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


def _tls_context(tls: "MetricsTls") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as e:
        raise OSError(f"metrics.tls: cannot use cert_file {tls.cert_file} with key_file {tls.key_file}: {e}") from e
    return ctx


def _basic_auth_checker(auth: "MetricsBasicAuth") -> Callable[[str], bool]:
    """A check of an Authorization header against the configured user and password (file or bcrypt hash)."""
    if auth.password_file is not None:
        try:
            with open(auth.password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n").encode()
        except OSError as e:
            raise OSError(f"metrics.basic_auth.password_file {auth.password_file}: {e.strerror}") from e
        if not password:
            raise OSError(f"metrics.basic_auth.password_file {auth.password_file}: empty")
        def matches(given: bytes) -> bool:
            return hmac.compare_digest(given, password)
    else:
        import bcrypt

        hashed = auth.password_hash.encode()  # type: ignore[union-attr]
        # bcrypt costs tens of milliseconds by design; remember the one credential that passed, as a digest.
        passed: list[bytes] = []

        def matches(given: bytes) -> bool:
            digest = hashlib.sha256(given).digest()
            if passed and hmac.compare_digest(passed[0], digest):
                return True
            if bcrypt.checkpw(given, hashed):
                passed[:] = [digest]
                return True
            return False
    user = auth.username.encode()

    def authorized(header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            raw = base64.b64decode(value.strip(), validate=True)
        except ValueError:
            return False
        given_user, sep, given_password = raw.partition(b":")
        # Both compared every time so a wrong user takes as long as a wrong password.
        user_ok = hmac.compare_digest(given_user, user)
        return bool(sep) and matches(given_password) and user_ok
    return authorized
