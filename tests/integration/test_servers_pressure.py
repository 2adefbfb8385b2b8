"""The servers capability and admission against real HTTP servers, one process each, serving metric text shaped
like each kind's real exposition (inference_metrics.py): discovery through this host's /proc, every bad answer a
server can give, and admission on server pressure in the agent's loop with a fake GPU at vLLM's 92 %.

No root needed: loopback only, no BPF (latency and quota off; the quota writer is a recording fake). The kernel end
to end is in test_admission_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest
from prometheus_client.exposition import generate_latest

from qosagent.admission.capability import LIMITS_SERVICE
from qosagent.config import parse_text
from qosagent.daemon import Agent
from qosagent.gpu.backend import GpuProcess, GpuSample, GpuState
from qosagent.gpu.fake import FakeBackend
from qosagent.hostfs import HostFS
from qosagent.metrics import make_registry
from qosagent.servers.config import ServerConfig
from qosagent.servers.model import gpu_holders
from qosagent.servers.scraper import Scraper
from qosagent.status import render
from qosagent.tenants import TenantLimit
from testkit.agent import agent_env
from tests.integration.latency_helpers import free_port

SERVER = str(Path(__file__).with_name("inference_metrics.py"))


class MetricsServer:
    """One stand-in server process on 127.0.0.1:port, driven through its control file."""

    # What names the real servers' processes where the kind alone does not.
    NAMES = {"tgi": "text-generation-router", "triton": "tritonserver"}

    def __init__(self, tmp: Path, kind: str, port: int | None = None):
        self.kind, self.port = kind, port or free_port()
        self.control = tmp / f"{kind}-{self.port}.json"
        self.set(kv=0.30, waiting=0, running=4)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def set(self, **state: Any) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.control)  # never half a file

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, SERVER, self.kind, str(self.port), str(self.control),
                                      self.NAMES.get(self.kind, "")], env=agent_env())
        deadline = time.monotonic() + 30
        while not _listening(self.port):
            assert self.proc.poll() is None and time.monotonic() < deadline, "the metrics server did not start"
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def servers(tmp: Path, *kinds: str) -> Iterator[list[MetricsServer]]:
    started: list[MetricsServer] = []
    try:
        for k in kinds:
            started.append(MetricsServer(tmp, k))
        yield started
    finally:
        for s in started:
            s.stop()


def read_now(sc: Scraper) -> None:
    """One synchronous round, every server due (the thread does this on its own schedule)."""
    for t in sc.targets.values():
        t.next_at = 0.0
    sc.round()


def test_discovery_finds_each_kind_and_reads_its_fields(tmp_path: Path) -> None:
    with servers(tmp_path, "vllm", "sglang", "tgi", "triton") as srv:
        sc = Scraper(HostFS("/"), None, [s.port for s in srv])
        sc.rediscover()
        read_now(sc)
        got = {r.port: r for r in sc.part().servers}
        assert set(got) == {s.port for s in srv}
        # Triton's metrics are on port 8002 unless listed otherwise: this stand-in serves them on its own port.
        triton = srv[3]
        assert got[triton.port].url == "http://127.0.0.1:8002/metrics"
        listed = Scraper(HostFS("/"), [ServerConfig(port=triton.port, kind="triton",
                                                    metrics=f"http://127.0.0.1:{triton.port}/metrics")], [])
        listed.rediscover()
        read_now(listed)
        got[triton.port] = listed.part().servers[0]
        for s in srv:
            r = got[s.port]
            assert (r.kind, r.pid, r.known, r.reason) == (s.kind, s.pid, True, ""), r
            assert r.requests_waiting == 0 and r.requests_running == 4
            assert r.kv_cache_usage == pytest.approx(0.30)
        # TGI's reserved tokens over max_batch_total_tokens from its /info, read once it is known to be TGI.
        assert got[srv[2].port].missing == {"preemptions": "not exported by tgi",
                                            "generated_tokens": "not exported by tgi"}
        # Two servers' processes on one GPU: counted and reported.
        gpu = GpuState(True, gpus=(GpuSample(0, "g", 100, 92, processes=(GpuProcess(srv[0].pid, 1),
                                                                            GpuProcess(srv[1].pid, 1))),))
        assert gpu_holders(sc.part(), gpu) == {0: sorted([srv[0].port, srv[1].port])}


def test_a_listed_server_of_kind_auto_is_known_by_its_metric_names(tmp_path: Path) -> None:
    with servers(tmp_path, "tgi") as (s,):
        s.NAMES = {}  # noqa: N806 - nothing in its command line says TGI
        s.stop()
        s.start()
        sc = Scraper(HostFS("/"), [ServerConfig(port=s.port)], [])
        sc.rediscover()
        read_now(sc)
        r = sc.part().servers[0]
        assert (r.kind, r.known, r.requests_waiting) == ("tgi", True, 0)
        assert "read from /info" in r.missing["kv_cache_usage"]
        read_now(sc)  # TGI's /info is read once its kind is known
        assert sc.part().servers[0].kv_cache_usage == pytest.approx(0.30)


def test_discovery_leaves_a_process_of_no_known_kind_alone(tmp_path: Path) -> None:
    with servers(tmp_path, "vllm") as (s,):
        other = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port := free_port())],
                                 env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not _listening(port):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            sc = Scraper(HostFS("/"), None, [s.port, port])
            sc.rediscover()
            read_now(sc)
            got = {r.port: r for r in sc.part().servers}
            assert got[s.port].known and not got[port].known and got[port].kind == "generic"
            assert got[port].scrapes == {} and got[port].reason.startswith("not read")
        finally:
            other.terminate()
            other.wait(10)


@pytest.mark.parametrize(("mode", "result", "why", "timeout"), [
    ({"mode": "html"}, "garbage", "not a metrics exposition", 0.3),
    ({"mode": "garbage"}, "garbage", "not a metrics exposition", 0.3),
    ({"mode": "http500"}, "http_error", "HTTP 500", 0.3),
    ({"mode": "slow", "delay": 3}, "timeout", "no complete answer within 0.3s", 0.3),
    ({"mode": "trickle"}, "timeout", "no complete answer within 0.3s", 0.3),
    # Time enough to receive 32 MiB on a loaded machine: the size limit is what must stop it.
    ({"mode": "huge"}, "too_large", "answer over 32 MiB", 5.0),
])
def test_a_bad_answer_keeps_the_last_good_reading_until_it_ages_out(tmp_path: Path, mode: dict[str, Any],
                                                                     result: str, why: str, timeout: float) -> None:
    with servers(tmp_path, "vllm") as (s,):
        every = f"{timeout}s"
        sc = Scraper(HostFS("/"), [ServerConfig(port=s.port, kind="vllm", interval=every, timeout=every,
                                                stale_after=f"{max(1.0, 2 * timeout)}s")], [])
        s.set(kv=0.99, waiting=20)
        read_now(sc)
        assert sc.part().servers[0].kv_cache_usage == pytest.approx(0.99)
        s.set(kv=0.5, **mode)
        read_now(sc)
        r = sc.part().servers[0]
        assert r.scrapes.get(result) == 1 and why in r.reason
        assert r.known and r.kv_cache_usage == pytest.approx(0.99)  # still fresh: the last good reading stands
        deadline = time.monotonic() + 20
        while sc.part().servers[0].known:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = sc.part().servers[0]
        assert r.kv_cache_usage is None and r.requests_waiting is None and "stale after" in r.reason


def test_nan_down_counter_reset_and_restart_on_the_same_port(tmp_path: Path) -> None:
    with servers(tmp_path, "vllm") as (s,):
        sc = Scraper(HostFS("/"), [ServerConfig(port=s.port, kind="vllm", interval="100ms", timeout="100ms",
                                                stale_after="300ms")], [])
        sc.rediscover()
        s.set(kv=0.97, waiting=3, preemptions=9, mode="nan")
        read_now(sc)
        r = sc.part().servers[0]
        assert r.known and r.kv_cache_usage is None and r.missing["kv_cache_usage"] == "NaN from the server"
        assert r.requests_waiting == 3 and r.pid == s.pid
        s.set(kv=0.5, waiting=3, preemptions=2)
        read_now(sc)
        assert sc.part().servers[0].counter_resets == 1
        old = s.pid
        s.stop()
        read_now(sc)
        r = sc.part().servers[0]
        assert r.scrapes.get("down") == 1 and r.reason == "connection refused"
        time.sleep(0.4)
        assert not sc.part().servers[0].known
        s.start()  # a new process on the same port
        sc.rediscover()
        r = sc.part().servers[0]
        assert r.pid == s.pid != old and r.restarts == 1 and f"pid {old} -> {s.pid}" in r.reason
        read_now(sc)
        assert sc.part().servers[0].known


# ---- admission on server pressure, in the agent's loop ----

CONFIG = """
    interval: 100ms
    gpu: {backend: none}
    tiers:
      gold:   {slo_p99: 120ms, weight: 10, quota: {rps: 100, burst: 10}, floor: {rps: 20}}
      silver: {slo_p99: 350ms, weight: 5, quota: {rps: 100, burst: 10}}
      bronze: {slo_p99: 1200ms, weight: 1, quota: {rps: 100, burst: 10}}
    tenants:
      - {name: acme, tier: gold, match: {cidrs: [127.0.0.2/32]}}
      - {name: mid, tier: silver, match: {cidrs: [127.0.0.3/32]}}
      - {name: hobby, tier: bronze, match: {cidrs: [127.0.0.4/32]}}
    latency: {enabled: false, ports: [%d]}
    admission:
      enabled: true
      mode: enforce
      gpu_pressure: {gpus: [0], escalate_after: 200ms}
      server_pressure: {cut_every: 200ms}
"""
BASELINE = {n: TenantLimit(100, 10) for n in ("acme", "mid", "hobby")}  # the tiers' quotas, as admission reads them


class Limits:
    """The quota capability's LimitsWriter, recording what it was told."""

    def __init__(self) -> None:
        self.last: dict[str, TenantLimit] = {}

    def set_overrides(self, limits: Mapping[str, TenantLimit]) -> None:
        self.last = dict(limits)


def test_admission_on_a_vllm_server_at_92_percent_gpu_memory(tmp_path: Path) -> None:
    with servers(tmp_path, "vllm") as (s,):
        fake = FakeBackend.preset("single")
        fake.open()
        fake.gpus[0].memory_used = int(fake.gpus[0].memory_total * 0.92)  # what vLLM leaves by default
        fake.gpus[0].processes = [GpuProcess(s.pid, fake.gpus[0].memory_used)]
        a = Agent(parse_text(textwrap.dedent(CONFIG % s.port), "test.yaml"), HostFS("/"), gpu=fake)
        w = Limits()
        a.ctx.services[LIMITS_SERVICE] = w
        a.start()
        decided: list[Any] = []

        def ticks(n: int) -> None:
            for _ in range(n):
                decided.extend(a.tick().decisions)
                time.sleep(0.1)

        try:
            deadline = time.monotonic() + 20
            while not (p := a.latest.part("servers")) or not p.servers or not p.servers[0].known:
                assert time.monotonic() < deadline, p
                ticks(1)
            assert p.servers[0].kind == "vllm" and p.servers[0].pid == s.pid  # found on the watched port
            # ---- KV 0.30 with 92 % of GPU memory used: nobody shed, nobody cut ----
            ticks(30)
            assert decided == [] and w.last == {}
            st = a.status()
            assert st["admission"]["gpu"] == \
                f"not shedding: the server reports KV 30 % on port {s.port} (GPU 0 memory 92%)"
            assert st["admission"]["shed_tiers"] == 0
            assert all(t["signal"] == "config" for t in st["admission"]["tenants"])
            # ---- KV 0.99 and 20 waiting: bronze cut first, then silver; gold never under its floor ----
            s.set(kv=0.99, waiting=20, running=48)
            deadline = time.monotonic() + 60
            while w.last.get("acme", BASELINE["acme"]).rps > 20:
                assert time.monotonic() < deadline, w.last
                ticks(1)
            ticks(10)
            cuts = [(d.target, d.new) for d in decided]
            assert {d.action for d in decided} == {"cut"} and {d.reason for d in decided} == {"server_pressure"}
            first = {n: next(i for i, c in enumerate(cuts) if c[0] == n) for n in ("hobby", "mid", "acme")}
            assert first["hobby"] < first["mid"] < first["acme"]
            last_hobby = max(i for i, c in enumerate(cuts) if c[0] == "hobby")
            assert cuts[last_hobby][1] == 1.0 and last_hobby < first["mid"]  # bronze at min_rps before silver
            assert w.last["acme"] == TenantLimit(20.0, 20) and min(c[1] for c in cuts if c[0] == "acme") == 20.0
            st = a.status()
            acme = next(t for t in st["admission"]["tenants"] if t["tenant"] == "acme")
            assert (acme["signal"], acme["rule"]) == ("server", "cut, held at the tier floor")
            assert "kv_cache_usage 0.99 > 0.95" in acme["why"]
            text = generate_latest(make_registry(a)).decode()
            assert f'qosagent_server_kv_cache_usage_ratio{{kind="vllm",port="{s.port}"}} 0.99' in text
            assert f'qosagent_admission_server_pressure{{port="{s.port}"}} 1.0' in text
            assert 'qosagent_admission_limited{cause="server",tenant="acme",tier="gold"} 1.0' in text
            human = render(st)
            assert "SERVERS  found on the watched ports" in human and "server: cut, held at the tier floor" in human
            # ---- the KV cache drains below exit: the pressure ends, nothing more is cut ----
            s.set(kv=0.50, waiting=0, running=10)
            n = len(decided)
            ticks(25)
            assert a.latest.part("admission").server_pressure == frozenset()
            assert [d.action for d in decided[n:]] == []
            # ---- the server dies: its reading ages out to unknown, and nothing is decided on it ----
            s.stop()
            deadline = time.monotonic() + 20
            while a.latest.part("servers").servers[0].known:
                assert time.monotonic() < deadline
                ticks(1)
            assert "connection refused" in a.latest.part("servers").servers[0].reason
            assert [d.action for d in decided[n:]] == []
        finally:
            a.stop()
