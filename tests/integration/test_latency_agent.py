"""The agent, for real: BPF probes on two loopback HTTP servers of known delays, checked against what the client saw.

Runs as root with BPF (CI=true makes a missing capability a failure). Ports 18001/18002 are the issue's example
config; everything else (metrics port, status socket) is private to the test run.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import require
from testkit.agent import TIME_SCALE, AgentProcess, agent_argv, agent_env, status_socket
from tests.integration.latency_helpers import free_port, serving
from tests.kernel_modes import latency_modes

N = 30  # requests per server
# Under emulation (the kernel matrix's VMs) the Python client spends 3-4 ms of its own around each request, which
# no server-side clock can see (tests/vm/arrival_gap.py measured it beside the kernel's timestamps): longer delays
# there keep it inside the 10 % the quantiles are compared at, as it is natively.
DELAY = 1 if TIME_SCALE == 1 else 4
FAST_DELAY = 0.020 * DELAY
SLOW_DELAY = 0.080 * DELAY
SLOW_CHUNKS = 4
SLOW_PAUSE = 0.030 * DELAY
# How far below the client the agent's p95/p99 may be under emulation: one stall of the emulated client, which no
# server-side clock sees. Measured in the 6.1 VM (TCG, 2026-12-01): client minus agent at p95/p99 from -10 to +22 ms
# over 24 quantiles of two runs (the most: hobby's p99 time to headers, client 385.6 ms, agent 364.1 ms), 15 ms in
# an earlier CI run (p95 agent 92 ms, client 107 ms) and stalls of 15-17 ms seen alone on a loaded host.
CLIENT_STALL_S = 0.025
BUCKET_WIDTH = 1 / 16  # qosagent.hist: a quantile is interpolated inside a bucket at most 1/16 of its value wide


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # As uvicorn and most inference servers do: without it Nagle holds a small body behind the headers until the
    # client's delayed ACK, which the client sees and the server's last write (what the probe times) does not.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        port = self.server.server_address[1]
        if port == 18001:
            time.sleep(FAST_DELAY)
            body = b"ok\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        # The slow server streams its answer in chunks with pauses, like tokens from an LLM.
        time.sleep(SLOW_DELAY)
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(SLOW_CHUNKS):
            if i:
                time.sleep(SLOW_PAUSE)
            data = f"token {i}\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[None]:
    with serving((18001, 18002), Handler):
        yield


EXAMPLE = """\
interval: 100ms
metrics:
  listen: 127.0.0.1:{port}
status:
  socket: {sock}
tiers:
  gold:   {{slo_p99: 120ms, weight: 10}}
  silver: {{slo_p99: 350ms, weight: 5}}
  bronze: {{slo_p99: 1200ms, weight: 1}}
tenants:
  - name: acme
    tier: gold
    match: {{ports: [18001]}}
  - name: hobby
    tier: bronze
    match: {{ports: [18002]}}
"""


class AgentProc(AgentProcess):
    def __init__(self, tmp: Path, config_text: str):
        self.port = free_port()
        sock = status_socket()
        config = tmp / "qosagent.yaml"
        config.write_text(config_text.format(port=self.port, sock=sock))
        super().__init__(config, sock, tmp / "agent.log")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as r:
            return r.read().decode()


@pytest.fixture(params=latency_modes())
def agent(request: pytest.FixtureRequest, bpf: None, tmp_path: Path) -> Iterator[AgentProc]:
    with AgentProc(tmp_path, EXAMPLE + f"latency:\n  mode: {request.param}\n") as a:  # each mode this kernel offers
        yield a


def client_run(port: int, n: int) -> tuple[list[float], list[float]]:
    """n GETs, half on fresh connections and half on one keep-alive connection; client-side TTFB and response."""
    ttfb, total = [], []
    keep = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for i in range(n):
        conn = keep if i % 2 else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.connect() if conn.sock is None else None
        t0 = time.perf_counter()
        conn.request("GET", "/")
        resp = conn.getresponse()  # returns once the status line and headers (the first bytes) are in
        t1 = time.perf_counter()
        resp.read()
        t2 = time.perf_counter()
        ttfb.append(t1 - t0)
        total.append(t2 - t0)
        if conn is not keep:
            conn.close()
    keep.close()
    return ttfb, total


def exact_quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')


def series(text: str, name: str) -> dict[str, float]:
    """tenant -> value of the series `name` (labels other than tenant/tier must not vary)."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[labels["tenant"]] = float(m.group(3))
    return out


def wait_for(agent: AgentProc, want: dict[str, int], timeout: float = 15.0) -> str:
    end = time.monotonic() + timeout
    text = ""
    while time.monotonic() < end:
        text = agent.scrape()
        got = series(text, "qosagent_latency_requests_total")
        if all(got.get(t) == n for t, n in want.items()):
            return text
        time.sleep(0.2)
    pytest.fail(f"request counts never reached {want}: {series(text, 'qosagent_latency_requests_total')}")


@pytest.mark.privileged
def test_per_tenant_latency_matches_the_client(agent: AgentProc, servers: None) -> None:
    measured = {"acme": client_run(18001, N), "hobby": client_run(18002, N)}
    text = wait_for(agent, {"acme": N, "hobby": N})
    # Exact counts: every request counted once, none lost, none unpaired. ("unmatched" is left out: the example
    # config also watches the default inference ports, where other software on this host may be serving.)
    requests = series(text, "qosagent_latency_requests_total")
    ttfb = series(text, "qosagent_latency_headers_seconds_count")
    assert (requests["acme"], requests["hobby"]) == (N, N)
    assert (ttfb["acme"], ttfb["hobby"]) == (N, N)
    for tenant in ("acme", "hobby"):
        assert series(text, "qosagent_latency_requests_unpaired_total").get(tenant) == 0
    st = agent.status()["latency"]
    # The servers' process was learned from its socket reads, and its threads' waits for a CPU measured.
    assert st["runqueue_total"]["count"] > 0
    rows = {t["tenant"]: t for t in st["tenants"]}
    kinds = {tenant: {"headers_total": ttfb, "response_total": total} for tenant, (ttfb, total) in measured.items()}
    compared = [(tenant, kind, key, rows[tenant][kind][key], exact_quantile(values, q))
                for tenant, by_kind in kinds.items() for kind, values in by_kind.items()
                for q, key in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))]
    # Shown with a failure, and the data the tolerances below come from (collected with -s).
    client_ms = {t: {k: [round(v * 1e3, 1) for v in sorted(vs)] for k, vs in by.items()} for t, by in kinds.items()}
    print("latency_quantiles " + json.dumps({"delay": DELAY, "compared": compared, "client_ms": client_ms}))
    for tenant, kind, key, got, truth in compared:
        if DELAY == 1:
            # Natively the p99 of 30 requests is the slowest one and the p95 the next, and on a loaded 2-CPU host the
            # client itself can be held off a CPU for a few ms after the server's last write, which no server-side
            # clock sees (CI, 2026-12-02: acme's slowest, 26.9 ms at the client, the rest 20.8-22.0; the agent's p99
            # 21.9 ms). So the agent may match the client's quantile with its slowest request or without it, at 10 %.
            values = kinds[tenant][kind]
            without = exact_quantile(sorted(values)[:-1], float(key[1:]) / 100)
            assert min(truth, without) * 0.90 <= got <= truth * 1.10, (tenant, kind, key, got, truth, without)
            continue
        if key != "p50":
            # Under emulation the p95 and p99 of 30 requests are the two slowest, and a stall of the emulated
            # client sets them where no server-side clock can see: the agent is below the client by up to one such
            # stall (and its bucket's width), above it by no more than the 10 % of native runs.
            low = truth * (1 - BUCKET_WIDTH) - CLIENT_STALL_S
            assert low <= got <= truth * 1.10, (tenant, kind, key, got, truth, low)
            continue
        assert got == pytest.approx(truth, rel=0.10), (tenant, kind, key, got, truth)
    # The slow server's response really spans its chunks: response - TTFB is the streaming time.
    assert rows["hobby"]["response_total"]["p50"] - rows["hobby"]["headers_total"]["p50"] >= \
        (SLOW_CHUNKS - 1) * SLOW_PAUSE * 0.9


@pytest.mark.privileged
def test_status_json_agrees_with_metrics_and_promtool_is_clean(agent: AgentProc, servers: None) -> None:
    client_run(18001, 6)
    client_run(18002, 4)
    text = wait_for(agent, {"acme": 6, "hobby": 4})
    st = agent.status()
    rows = {t["tenant"]: t for t in st["latency"]["tenants"]}
    assert set(rows) == set(series(text, "qosagent_latency_requests_total"))
    # The example's tenants are quiet now; "unmatched" may see other software on the default ports between the two.
    for tenant in ("acme", "hobby"):
        r = rows[tenant]
        assert r["requests"] == series(text, "qosagent_latency_requests_total")[tenant]
        assert r["headers_total"]["count"] == series(text, "qosagent_latency_headers_seconds_count")[tenant]
        assert r["response_total"]["count"] == series(text, "qosagent_latency_response_seconds_count")[tenant]
        assert r["response_total"]["p50"] is not None
    assert {t: r["tier"] for t, r in rows.items()} == {"acme": "gold", "hobby": "bronze", "unmatched": "none"}
    assert rows["acme"]["slo"] == "ok"
    require(shutil.which("promtool") is not None, "promtool not installed")
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), \
        check.stdout + check.stderr
    human = subprocess.run(agent_argv("status", "--socket", agent.socket), env=agent_env(), capture_output=True,
                           text=True, timeout=30, check=True).stdout
    assert re.search(r"^acme\s+gold\s+6\s", human, re.M), human
    assert re.search(r"^hobby\s+bronze\s+4\s", human, re.M), human


@pytest.mark.privileged
def test_stop_leaves_no_program_attached_and_detach_unloads_them(bpf: None, tmp_path: Path) -> None:
    require(shutil.which("bpftool") is not None, "bpftool not installed")
    a = AgentProc(tmp_path, EXAMPLE)
    try:
        a.start()
        programs = a.status()["latency"]["programs"]
        assert programs, "the agent reported no loaded programs"
        for p in programs:
            assert subprocess.run(["bpftool", "prog", "show", "id", str(p["id"])], capture_output=True).returncode == 0
    finally:
        rc = a.stop()
    assert rc == 0, a.output()
    # Kept for the next agent (its build stays pinned), attached nowhere: no link and no perf event holds them.
    ids = {p["id"] for p in programs}
    links = json.loads(subprocess.run(["bpftool", "-j", "link", "show"], capture_output=True, text=True,
                                      check=True).stdout or "[]")
    perf = json.loads(subprocess.run(["bpftool", "-j", "perf", "show"], capture_output=True, text=True,
                                     check=True).stdout or "[]")
    assert not [x for x in links + perf if x.get("prog_id") in ids], (links, perf)
    subprocess.run(agent_argv("detach", "--config", a.config), env=agent_env(), check=True, timeout=60,
                   capture_output=True)
    for p in programs:
        gone = subprocess.run(["bpftool", "prog", "show", "id", str(p["id"])], capture_output=True, text=True)
        assert gone.returncode != 0, f"program {p} still loaded after qosagent detach: {gone.stdout}"
