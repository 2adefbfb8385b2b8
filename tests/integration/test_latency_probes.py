"""The latency program in-process, in its sockops and tracepoint modes: tenant resolution by port and client
address, unmatched traffic, multiplexed ports, reload in place, pipelined requests (tracepoint mode), and the kprobe
fallback for kernels without the sock_*_length tracepoints."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import time
from typing import Any, Iterator

import pytest

from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.features import probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from qosagent.latency.datapath import KPROBE_ARRIVAL, KPROBES, sources
from qosagent.latency.model import LatencyPart, Plan
from qosagent.tenants import tenant_id
from tests.integration.latency_helpers import serving
from tests.kernel_modes import READS, latency_modes

PORTS = (18011, 18012, 18013, 18014, 18015)


def config(lab_cidr: str, solo_port: int = 18014, mode: str = "auto", verify_within: float = 60.0) -> Any:
    return parse({
        "tenants": [
            {"name": "lab", "tier": "silver", "match": {"cidrs": [lab_cidr]}},
            {"name": "edge", "tier": "bronze", "match": {"ports": [18012], "cidrs": ["127.0.0.3/32"]}},
            {"name": "solo", "tier": "gold", "match": {"ports": [solo_port]}},
        ],
        "latency": {"mode": mode, "ports": [18011, 18012, 18014], "multiplexed_ports": [18013],
                    "verify_within": f"{verify_within:g}s"},
    }, "test")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802
        time.sleep(0.005)
        self.send_response(200)
        if self.path != "/stream":
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"ok\n")
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(3):
            time.sleep(0.03)
            self.wfile.write(b"3\r\nok\n\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[None]:
    with serving(PORTS, Handler):
        yield


@contextlib.contextmanager
def started(mode: str, verify_within: float = 60.0) -> Iterator[Latency]:
    from qosagent import features

    fs = HostFS("/")
    features.ensure_mounted(fs)
    cap = Latency(AgentContext(config=config("127.0.0.2/32", mode=mode, verify_within=verify_within), hostfs=fs,
                               gpu=NoGpu("test")))
    feats = probe(fs)
    verdict = cap.probe(feats)
    assert verdict.state is State.ACTIVE
    assert verdict.plan.mode == mode  # only modes this kernel offers are asked for (tests/kernel_modes.py)
    assert verdict.plan.arrival == (mode == "sockops" or feats.has_tracepoint("sock/sk_data_ready") or (
        mode == "kprobe" and feats.kprobe_functions[KPROBE_ARRIVAL[0]])), \
        "the arrival clock must be in use wherever the kernel has a hook for it"
    cap.verdict = verdict  # as the agent does: start lowers it where it finds less
    cap.start(verdict.plan)
    try:
        yield cap
    finally:
        cap.stop()


@pytest.fixture(params=latency_modes())
def latency(request: pytest.FixtureRequest, bpf: None) -> Iterator[Latency]:
    with started(request.param) as cap:
        yield cap


@pytest.fixture(params=latency_modes(*READS))
def tracepoint_latency(request: pytest.FixtureRequest, bpf: None) -> Iterator[Latency]:
    """A mode that sees reads: tracepoint, or its kprobe fallback on older kernels."""
    with started(request.param) as cap:
        yield cap


def get(port: int, source: str, n: int = 1) -> None:
    for _ in range(n):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
        c.request("GET", "/")
        c.getresponse().read()
        c.close()


def settle(cap: Latency, want: dict[str, int]) -> LatencyPart:
    end = time.monotonic() + 10
    while True:
        part = cap.collect()
        got = {name: t.requests for name, t in part.tenants.items()}
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > end:
            return part
        time.sleep(0.1)


@pytest.mark.privileged
def test_tenants_resolve_by_port_then_client_address(latency: Latency, servers: None) -> None:
    get(18011, "127.0.0.2", 3)  # lab: its address on any watched port
    get(18012, "127.0.0.3", 2)  # edge: its address on its port
    get(18011, "127.0.0.3", 4)  # edge's address, but not on edge's port: unmatched
    get(18012, "127.0.0.1", 1)  # unmatched
    get(18013, "127.0.0.1", 2)  # multiplexed port: counted as connections, never timed
    get(18014, "127.0.0.2", 2)  # lab's address on solo's port: the port comes first
    part = settle(latency, {"lab": 3, "edge": 2, "unmatched": 5, "solo": 2})
    got = {name: t.requests for name, t in part.tenants.items()}
    assert got == {"lab": 3, "edge": 2, "unmatched": 5, "solo": 2}
    un = part.tenants["unmatched"]
    assert un.multiplexed_connections == 2 and un.connections == 7 and un.tier == "none"
    assert un.overlapped == 0
    assert part.tenants["lab"].headers.count == 3 and part.tenants["lab"].unpaired == 0
    assert part.tenants["lab"].headers.quantile(0.5) >= 0.005


@pytest.mark.privileged
def test_a_request_sent_during_a_response_is_counted_overlapped_not_timed(tracepoint_latency: Latency,
                                                                           servers: None) -> None:
    """Tracepoint mode only: sockops mode sees no reads, so it cannot tell a pipelined request from the next one
    (docs/latency.md)."""
    latency = tracepoint_latency
    with socket.create_connection(("127.0.0.1", 18011), source_address=("127.0.0.2", 0), timeout=10) as c:
        c.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.045)  # the first chunk is out, the rest are still coming: HTTP/1.1 pipelining
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while c.recv(65536):
            pass
    end = time.monotonic() + 10
    while True:
        lab = latency.collect().tenants["lab"]
        if lab.overlapped or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert (lab.overlapped, lab.requests, lab.headers.count, lab.in_flight, lab.unpaired) == (1, 1, 1, 0, 0)
    # The first request is timed through its last chunk (3 x 30 ms), not cut short by the second's arrival.
    assert lab.response.quantile(0.5) >= 0.09


@pytest.mark.privileged
def test_reload_rewrites_the_tenant_maps_in_place(latency: Latency, servers: None) -> None:
    from qosagent.ebpf.tenant_ports import read_claims

    fd_before = latency.dp.map("tenant_cidrs").fd
    ports = latency.dp.map("tenant_ports").fd
    assert read_claims(ports) == {18014: (tenant_id("solo"), 0)}
    new = config("127.0.0.4/32", solo_port=18015, mode=latency.mode)
    latency.prepare(new).commit()
    latency.ctx.config = new
    assert latency.dp.map("tenant_cidrs").fd == fd_before
    assert len(latency.dp.map("tenant_cidrs").keys()) == 2  # lab's new address and edge's, nothing stale
    assert read_claims(ports) == {18015: (tenant_id("solo"), 0)}  # solo's old port zeroed
    get(18011, "127.0.0.2", 2)  # lab's old address: unmatched now
    get(18011, "127.0.0.4", 1)
    get(18014, "127.0.0.1", 1)  # solo's old port (still watched): unmatched now
    get(18015, "127.0.0.1", 1)
    part = settle(latency, {"lab": 1, "unmatched": 3, "solo": 1})
    assert part.tenants["lab"].requests == 1
    assert part.tenants["unmatched"].requests == 3
    assert part.tenants["solo"].requests == 1


@pytest.mark.privileged
def test_kprobe_fallback_compiles_and_loads(bpf: None) -> None:
    """Where the kernel has no kprobes to attach to, what can be checked is that the fallback passes the verifier
    (tests/vm runs it attached, on 6.1)."""
    from bcc import BPF

    from qosagent.ebpf.loader import compile_program

    b = compile_program(sources(Plan(mode="kprobe", arrival=True, egress=True, runq=False)),
                        {"QOS_KPROBE": 1, "QOS_ARRIVAL": 1, "QOS_EGRESS": 1})
    try:
        for _event, prog in KPROBES:
            assert b.load_func(prog.encode(), BPF.KPROBE).fd >= 0
        assert b.load_func(KPROBE_ARRIVAL[1].encode(), BPF.KPROBE).fd >= 0
        # Its cgroup_skb programs: responses read as they leave, and connections open before the agent adopted.
        for prog in ("lat_egress", "lat_egress_framing", "lat_adopt_ingress"):
            assert b.load_func(prog.encode(), BPF.CGROUP_SKB).fd >= 0
        # The kprobe build must not also attach the socket tracepoints (each event would be counted twice), nor
        # sk_data_ready, which kernels that need the kprobes do not have.
        assert not any(b"sock_recv_length" in tp or b"sock_send_length" in tp or b"sk_data_ready" in tp
                       for tp in list(b.tracepoint_fds) + list(b.raw_tracepoint_fds))
    finally:
        b.cleanup()
