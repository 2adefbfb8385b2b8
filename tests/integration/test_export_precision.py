"""Export precision (docs/latency.md, "Export precision"): a real Prometheus computes p50/p95/p99 with
histogram_quantile within 10 % of the truth, from native histograms (protobuf, native histograms on) and from the
classic buckets (text, native histograms off).

Most of it scrapes the agent's real metrics endpoint serving a latency part built from known values (a clustered
lognormal, the case where the old two-buckets-per-octave layout read p99 ~20 % high), so the truth is exact; the
counts grow every second so that rate() runs over them too. One test runs the real agent under real traffic."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import math
import random
import subprocess
import threading
import time
import urllib.request
from typing import Any, Iterable, Iterator

import pytest
import yaml

from qosagent import config as config_mod
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hist import Histogram
from qosagent.hostfs import HostFS
from qosagent.latency import export
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.metrics import MetricsServer
from qosagent.snapshot import Snapshot
from testkit.agent import AgentProcess, agent_argv, agent_env
from tests.integration.latency_helpers import free_port, serving
from tests.integration.prometheus_helpers import DEADLINE_S, api, query, run_prometheus, wait_for
from tests.integration.test_ship_prometheus import dashboard_exprs

pytestmark = [pytest.mark.slow]

QS = (0.5, 0.95, 0.99)
OFF = {c: {"enabled": False} for c in ("latency", "quota", "admission", "dvfs", "placement")}
SIGNALS = ("headers", "ttft", "response", "inter_token")
HISTOGRAMS = tuple(f"qosagent_latency_{s}_seconds" for s in SIGNALS) + tuple(
    f"qosagent_latency_tier_{s}_seconds" for s in SIGNALS) + ("qosagent_latency_runqueue_seconds",)


def lognormal_ns(median_s: float, sigma: float, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.lognormvariate(math.log(median_s * 1e9), sigma)) for _ in range(n)]


def true_quantile(values_ns: list[int], q: float) -> float:
    s = sorted(values_ns)
    return s[math.ceil(q * len(s)) - 1] / 1e9


# tenant -> (median, sigma): the case (45 ms, sigma 0.2), a wider one and a slow one.
TENANTS = {"chat": (0.045, 0.2), "embed": (0.008, 0.5), "batch": (0.300, 0.3)}
VALUES = {name: lognormal_ns(m, s, 20000, seed) for seed, (name, (m, s)) in enumerate(TENANTS.items(), 1)}
RUNQ = lognormal_ns(0.000050, 1.0, 20000, 9)


def scaled(h: Histogram, m: int) -> Histogram:
    return Histogram({i: c * m for i, c in h.counts.items()}, h.sum_ns * m)


class KnownLatency:
    """Stands in for the latency capability: the same histograms, every count multiplied by the seconds since start
    (so they grow as a real agent's do and rate() sees the same distribution)."""

    name = "latency"

    def __init__(self, buckets: Any) -> None:
        self.t0 = time.monotonic()
        self.buckets = buckets
        self.hist = {name: Histogram.of(v) for name, v in VALUES.items()}
        self.runq = Histogram.of(RUNQ)

    def traffic(self, _snapshot: Any) -> dict[str, tuple[int, ...]]:
        return {}  # every tenant shown

    def metrics(self, _snapshot: Any, _shown: Any) -> Iterable[Any]:
        m = 1 + int(time.monotonic() - self.t0)
        tenants = {}
        for name, h in self.hist.items():
            h = scaled(h, m)
            tenants[name] = TenantLatency(tenant=name, tier="gold", requests=h.count, headers=h, ttft=h, response=h,
                                          inter_token=h, headers_window=h, ttft_window=h, response_window=h,
                                          inter_token_window=h, rate_rps=0.0)
        runq = scaled(self.runq, m)
        part = LatencyPart(10.0, tenants, runq, self.runq, {"gold": runq}, {"gold": self.runq})
        return export.families(part, 1, "ttft", 0.95, self.buckets)


@pytest.fixture(scope="module")
def known_endpoint() -> Iterator[str]:
    """The agent's metrics server (content negotiation, every family of the agent's own collector) over a latency
    part made of VALUES."""
    cfg = config_mod.parse({"metrics": {"listen": "127.0.0.1:0"}, **OFF}, "test")
    agent = Agent(cfg, HostFS("/"), gpu=NoGpu("test"))
    agent.capabilities.append(KnownLatency(cfg.latency.classic_buckets))  # type: ignore[arg-type]
    srv = MetricsServer(agent, cfg.metrics.listen)
    srv.start()
    stop = threading.Event()

    def ticks() -> None:  # a scrape is built once per snapshot: a new one each tick, as the agent's loop makes
        while not stop.wait(0.2):
            agent.latest = Snapshot.build(agent.latest.seq + 1, time.monotonic(), time.time(), {})

    ticking = threading.Thread(target=ticks, daemon=True)
    ticking.start()
    try:
        yield f"127.0.0.1:{srv.address[1]}"
    finally:
        stop.set()
        ticking.join()
        srv.close()


def _job(target: str) -> list[dict[str, Any]]:
    return [{"job_name": "qosagent", "static_configs": [{"targets": [target]}]}]


@pytest.fixture(scope="module")
def native_prom(known_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_prometheus(tmp_path_factory.mktemp("prom-native"), _job(known_endpoint), native=True) as url:
        yield url


@pytest.fixture(scope="module")
def classic_prom(known_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_prometheus(tmp_path_factory.mktemp("prom-classic"), _job(known_endpoint)) as url:
        yield url


def value(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def within(got: float, want: float, tol: float = 0.10) -> bool:
    return abs(got - want) <= tol * want


def check_quantiles(url: str, selector: str, rate: bool) -> list[str]:
    """Prometheus' histogram_quantile for each tenant and quantile against the truth; the misses, described."""
    misses = []
    for tenant in TENANTS:
        for q in QS:
            sel = selector.format(tenant=tenant)
            expr = f"histogram_quantile({q}, {f'rate({sel}[5s])' if rate else sel})"
            got = value(query(url, expr))
            truth = true_quantile(VALUES[tenant], q)
            agent_own = Histogram.of(VALUES[tenant]).quantile(q)
            assert agent_own is not None
            print(f"{expr}: {got:.6f}, truth {truth:.6f} ({100 * (got - truth) / truth:+.2f} %), "
                  f"agent {agent_own:.6f}")
            if not (within(got, truth) and within(got, agent_own)):
                misses.append(f"{expr} = {got}, truth {truth}, agent {agent_own}")
    return misses


def test_native_histograms_reach_prometheus(native_prom: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    # A native series answers the bare name with a histogram; there are no _bucket series beside it.
    got = wait_for("native histograms", lambda: query(native_prom, 'qosagent_latency_response_seconds{tenant="chat"}'),
                   deadline)
    assert "histogram" in got[0], got
    assert query(native_prom, "qosagent_latency_response_seconds_bucket") == []
    runq = query(native_prom, "qosagent_latency_runqueue_seconds")
    assert runq and "histogram" in runq[0], runq


def test_native_quantiles_within_ten_percent(native_prom: str) -> None:
    wait_for("two scrapes of the native histograms", lambda: query(
        native_prom, 'histogram_count(rate(qosagent_latency_response_seconds{tenant="chat"}[5s])) > 0'),
        time.monotonic() + DEADLINE_S)
    misses = check_quantiles(native_prom, 'qosagent_latency_response_seconds{{tenant="{tenant}"}}', rate=False)
    misses += check_quantiles(native_prom, 'qosagent_latency_response_seconds{{tenant="{tenant}"}}', rate=True)
    assert not misses, misses


def test_native_buckets_never_go_down(native_prom: str) -> None:
    """Counts grow by len(VALUES) per second; a native bucket that went down between two scrapes would read as a
    counter reset and rate() would jump to the whole count."""
    n = len(VALUES["chat"])
    # A window that starts before the series does is extrapolated less: wait until 10 s of scrapes are in.
    wait_for("ten seconds of scrapes", lambda: query(
        native_prom, 'count_over_time(qosagent_latency_requests_total{tenant="chat"}[12s]) >= 11'),
        time.monotonic() + 60)
    for tenant in TENANTS:
        r = value(query(native_prom,
                        f'histogram_count(rate(qosagent_latency_response_seconds{{tenant="{tenant}"}}[10s]))'))
        assert 0.7 * n <= r <= 1.3 * n, (tenant, r, n)


def test_classic_quantiles_within_ten_percent(classic_prom: str) -> None:
    wait_for("two scrapes of the classic buckets", lambda: query(
        classic_prom, 'rate(qosagent_latency_response_seconds_count{tenant="chat"}[5s]) > 0'),
        time.monotonic() + DEADLINE_S)
    assert query(classic_prom, "qosagent_latency_response_seconds") == []  # text: no native series
    misses = check_quantiles(classic_prom, 'qosagent_latency_response_seconds_bucket{{tenant="{tenant}"}}', rate=False)
    misses += check_quantiles(classic_prom, 'qosagent_latency_response_seconds_bucket{{tenant="{tenant}"}}', rate=True)
    assert not misses, misses


def test_protobuf_carries_every_family_text_does(native_prom: str, classic_prom: str) -> None:
    """The same metric names reach both, but for each histogram's _bucket/_sum/_count, native under its own name."""
    def names(url: str) -> set[str]:
        return {n for n in api(url, "label/__name__/values") if n.startswith("qosagent_")}

    wait_for("both Prometheus to have scraped", lambda: names(native_prom) and names(classic_prom),
             time.monotonic() + DEADLINE_S)
    classic, native = names(classic_prom), names(native_prom)
    expected = {n for n in classic if not any(n in (h + "_bucket", h + "_sum", h + "_count") for h in HISTOGRAMS)}
    assert native == expected | set(HISTOGRAMS), (sorted(native ^ (expected | set(HISTOGRAMS))))
    # And the same values: a counter, a gauge, a summary quantile.
    for expr in ('qosagent_latency_requests_total{tenant="chat"}', "qosagent_latency_programs_attached",
                 'qosagent_latency_response_window_seconds{tenant="chat", quantile="0.99"}'):
        a, b = query(native_prom, expr), query(classic_prom, expr)
        assert a and b and float(a[0]["value"][1]) == pytest.approx(float(b[0]["value"][1]), rel=0.5), expr


def test_dashboard_quantile_panels_work_on_native_and_classic(native_prom: str, classic_prom: str) -> None:
    """deploy/grafana's histogram_quantile panels read native series where there are some, else classic buckets."""
    exprs = [e for e in dashboard_exprs() if "histogram_quantile" in e]
    assert exprs and all(" or " in e for e in exprs)
    wait_for("ten seconds of scrapes", lambda: all(query(url, 'count_over_time(qosagent_latency_requests_total'
                                                          '{tenant="chat"}[12s]) >= 11')
                                                    for url in (native_prom, classic_prom)),
             time.monotonic() + 60)
    for expr in exprs:
        concrete = expr.replace("$instance", ".*").replace("$tenant", "chat").replace("$__rate_interval", "5s")
        for url in (native_prom, classic_prom):
            got = query(url, concrete)
            assert len(got) == 1, (url, concrete, got)
            if "response" in expr:
                q = float(concrete.split("(", 2)[1].split(",")[0])
                assert within(float(got[0]["value"][1]), true_quantile(VALUES["chat"], q)), (url, concrete, got)


# ---- the real agent, real traffic --------------------------------------------------------------------------------
class Clustered(http.server.BaseHTTPRequestHandler):
    """Answers after a lognormal time around 45 ms (sigma 0.2): the issue's tenant."""

    rng = random.Random(45)
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        with self.lock:
            delay = self.rng.lognormvariate(math.log(0.045), 0.2)
        time.sleep(delay)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture(scope="module")
def real_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("agent")
    port, tenant_port = free_port(), free_port()
    conf = d / "config.yaml"
    conf.write_text(yaml.safe_dump({
        "interval": "200ms",
        "tenants": [{"name": "chat", "tier": "gold", "match": {"ports": [tenant_port]}}],
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "status": {"socket": str(d / "status.sock")},
        **{c: {"enabled": False} for c in ("admission", "dvfs", "placement")},
    }))
    with AgentProcess(conf, str(d / "status.sock"), d / "agent.log") as agent:
        assert _ready(port)
        yield {"port": port, "tenant_port": tenant_port, "sock": agent.socket, "dir": d}


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


def _timed_get(url: str) -> float:
    t = time.monotonic()
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == b"ok"
    return time.monotonic() - t


@pytest.mark.privileged
def test_real_agent_native_quantiles_match_its_own(real_agent: dict[str, Any], bpf: None,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    n = 600
    url = f"http://127.0.0.1:{real_agent['tenant_port']}/"
    with run_prometheus(tmp_path_factory.mktemp("prom-agent"), _job(f"127.0.0.1:{real_agent['port']}"),
                        native=True) as prom:
        with serving((real_agent["tenant_port"],), Clustered):
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                client = list(pool.map(_timed_get, [url] * n))
            sel = 'qosagent_latency_response_seconds{tenant="chat"}'
            wait_for("all the requests in Prometheus' native histogram",
                     lambda: query(prom, f"histogram_count({sel}) >= {n}"), time.monotonic() + DEADLINE_S)
        out = subprocess.run(agent_argv("status", "--json", "--socket", real_agent["sock"]), env=agent_env(),
                             capture_output=True, text=True, timeout=30, check=True)
        own = next(t for t in json.loads(out.stdout)["latency"]["tenants"] if t["tenant"] == "chat")["response_total"]
        assert own["count"] == n
        misses = []
        for q in QS:
            got = value(query(prom, f"histogram_quantile({q}, {sel})"))
            agent_q = own[f"p{round(q * 100)}"]
            client_q = sorted(client)[math.ceil(q * n) - 1]
            print(f"p{round(q * 100)}: Prometheus {got:.6f} agent {agent_q:.6f} client {client_q:.6f}")
            # Within 10 % of the agent's own quantile (what the export must not lose), and of the client's up to p95.
            # The p99 of 600 is the 6 slowest requests, which the 8-thread Python client on 2 CPUs delays itself (its
            # clock counts its own side of loopback): seen at 17 % over the agent's there.
            if not (within(got, agent_q) and (q > 0.95 or within(got, client_q))):
                misses.append((q, got, agent_q, client_q))
        assert not misses, misses

