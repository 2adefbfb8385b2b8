"""Time to first token, inter-token gaps and completion, against a real streaming server and real clients.

The server is FastAPI on uvicorn in its own process, streaming OpenAI-style Server-Sent Events (what vLLM does):
headers when the handler returns, the first token after a prefill delay, then one event per token. What the agent
measures in the kernel is compared with what the clients (httpx, aiohttp, raw sockets) saw, in every latency mode
this kernel offers. Runs as root with BPF (CI=true makes a missing capability a failure).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import Iterator

import pytest

from qosagent.latency.capability import Latency
from qosagent.latency.model import TenantLatency
from tests.integration.latency_helpers import close_to, free_port, latency_capability, until
from testkit.sse_client import (
    aiohttp_requests,
    RawClient,
    Timing,
    disconnect_before_first_token,
    expect_continue_request,
    httpx_requests,
    percentile,
    request_bytes,
    split_body_request,
)
from testkit.sse_server import sse_server
from tests.kernel_modes import latency_modes

N = 40  # streamed requests per run


@pytest.fixture(params=latency_modes())
def agent(request: pytest.FixtureRequest, bpf: None) -> Iterator[tuple[Latency, int]]:
    """The latency capability in the given mode, watching a free port that the test's server will serve."""
    port = free_port()
    with latency_capability(request.param, port, [{"name": "chat", "tier": "gold", "match": {"ports": [port]}}]) as cap:
        yield cap, port


def tenant(cap: Latency) -> TenantLatency:
    return cap.collect().tenants["chat"]


def prefills(n: int, seed: int) -> list[float]:
    """Prefill delays clustered around 45 ms (lognormal, sigma 0.2), as a loaded server's time to first token."""
    rng = random.Random(seed)
    return [round(45.0 * rng.lognormvariate(0.0, 0.2), 1) for _ in range(n)]


@pytest.mark.privileged
@pytest.mark.slow
@pytest.mark.parametrize("client", ["httpx", "aiohttp"])
def test_ttft_and_inter_token_latency_match_the_streaming_client(agent: tuple[Latency, int], client: str) -> None:
    cap, port = agent
    bodies = [{"stream": True, "prefill_ms": p, "token_ms": 20.0, "tokens": 6} for p in prefills(N, 13)]
    with sse_server("uvicorn", port=port):
        send = httpx_requests if client == "httpx" else aiohttp_requests
        timings = send(f"http://127.0.0.1:{port}", bodies, concurrency=4)
        t = until(lambda: tenant(cap), lambda t: t.requests >= N and t.ttft.count >= N)
    assert all(x.done for x in timings)
    # Counts exact: every request, every first token. Body writes after the first: 5 tokens, [DONE] and the chunked
    # end, 7, unless the last two left in one segment (written back to back, they may).
    assert (t.requests, t.ttft.count, t.headers.count, t.unpaired) == (N, N, N, 0), t
    assert N * 6 <= t.inter_token.count <= N * 7, t.inter_token.count
    assert t.no_ttft == {} and t.pipelined == 0, (t.no_ttft, t.pipelined)
    ttft = [x.ttft for x in timings]
    for q in (0.5, 0.95):
        assert close_to(t.ttft.quantile(q), percentile(ttft, q)), (q, t.ttft.quantile(q), percentile(ttft, q))
    # The headers leave when the handler returns, long before the first token: a separate signal, not the TTFT.
    assert t.headers.quantile(0.95) < 0.5 * percentile(ttft, 0.5), (t.headers.quantile(0.95), ttft)
    gaps = [g for x in timings for g in x.gaps]
    assert close_to(t.inter_token.quantile(0.5), percentile(gaps, 0.5)), (t.inter_token.quantile(0.5), gaps)


@pytest.mark.privileged
@pytest.mark.slow
def test_responses_on_idle_keepalive_connections_complete_at_their_last_byte(agent: tuple[Latency, int]) -> None:
    """Streams on connections that stay open and idle afterwards are counted within a second of their end."""
    cap, port = agent
    with sse_server("uvicorn", port=port):
        clients = [RawClient(port) for _ in range(3)]
        try:
            for _ in range(4):
                for c in clients:
                    head, rest = request_bytes(c.h11, {"stream": True, "prefill_ms": 30.0, "token_ms": 5.0,
                                                       "tokens": 3})
                    c.sock.sendall(head + rest)
                for c in clients:
                    c.read(Timing(time.perf_counter()))
                    c.h11.start_next_cycle()
            done = time.monotonic()
            t = until(lambda: tenant(cap), lambda t: t.requests >= 12, timeout=1.0)
            assert time.monotonic() - done <= 1.5
            assert (t.requests, t.in_flight, t.framed) == (12, 0, 12), t
        finally:
            for c in clients:
                c.close()


@pytest.mark.privileged
@pytest.mark.slow
def test_one_write_interim_responses_split_bodies_and_json(agent: tuple[Latency, int]) -> None:
    cap, port = agent
    body = {"stream": True, "prefill_ms": 40.0, "token_ms": 5.0, "tokens": 2}
    with sse_server("single-write", port=port):
        one = [split_body_request(port, body) for _ in range(3)]  # head and body in two segments, 5 ms apart
        t = until(lambda: tenant(cap), lambda t: t.ttft.count >= 3)
        # Headers and first token in one write: both at that write; the request's second segment is no pipelining.
        assert (t.ttft.count, t.pipelined) == (3, 0), t
        assert close_to(t.ttft.quantile(0.5), percentile([x.ttft for x in one], 0.5))
        assert abs(t.headers.quantile(0.5) - t.ttft.quantile(0.5)) < 0.002
    with sse_server("uvicorn", port=port):
        cont = expect_continue_request(port, body)
        assert [s for s, _ in cont.interim] == [100]
        t = until(lambda: tenant(cap), lambda t: t.ttft.count >= 4 and t.interim >= 1)
        # The interim response is not the response: one request, timed from its headers to its first token.
        assert (t.interim, t.ttft.count, t.requests, t.unpaired) == (1, 4, 4, 0), t
        assert t.ttft.quantile(1.0) >= 0.035
        json_body = httpx_requests(f"http://127.0.0.1:{port}", [{"stream": False, "prefill_ms": 30.0, "tokens": 1}],
                                   concurrency=1)
        assert json_body[0].status == 200
        t = until(lambda: tenant(cap), lambda t: t.ttft.count >= 5)
        assert t.ttft.count == 5 and t.no_ttft == {}, t


@pytest.mark.privileged
@pytest.mark.slow
def test_what_cannot_be_read_is_counted_by_reason_never_timed(agent: tuple[Latency, int]) -> None:
    cap, port = agent
    with sse_server("uvicorn", port=port):
        gone = disconnect_before_first_token(port, {"stream": True, "prefill_ms": 200.0, "tokens": 2})
        assert gone.headers is not None and not gone.chunks
        t = until(lambda: tenant(cap), lambda t: t.no_ttft.get("no_body", 0) >= 1)
        assert (t.no_ttft, t.ttft.count) == ({"no_body": 1}, 0), t
    # Binary on a watched port: no HTTP status line, so no TTFT, while the first write is still timed.
    srv = socket.create_server(("127.0.0.1", port))

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(1024)
            time.sleep(0.01)
            conn.sendall(bytes(range(256)) * 4)
            conn.recv(1024)

    th = threading.Thread(target=answer, daemon=True)
    th.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"\x16\x03\x01\x00\x05hello")  # a TLS record's first bytes
            c.recv(4096)
        th.join(5)
    finally:
        srv.close()
    t = until(lambda: tenant(cap), lambda t: t.no_ttft.get("not_http", 0) >= 1)
    assert t.no_ttft == {"no_body": 1, "not_http": 1} and t.ttft.count == 0, t
    assert t.headers.count == 2



@pytest.mark.privileged
@pytest.mark.slow
def test_content_length_responses_complete_at_their_last_byte_on_idle_connections(agent: tuple[Latency, int]) -> None:
    """Non-streaming JSON (Content-Length framing), kept-alive and then idle: counted within a second."""
    cap, port = agent
    with sse_server("uvicorn", port=port):
        c = RawClient(port)
        try:
            for _ in range(3):
                head, rest = request_bytes(c.h11, {"stream": False, "prefill_ms": 20.0, "tokens": 2})
                c.sock.sendall(head + rest)
                c.read(Timing(time.perf_counter()))
                c.h11.start_next_cycle()
            t = until(lambda: tenant(cap), lambda t: t.requests >= 3, timeout=1.0)
            assert (t.requests, t.in_flight, t.framed, t.ttft.count) == (3, 0, 3, 3), t
        finally:
            c.close()


# Scripted responses of a raw server, by request path: what real servers and broken ones write.
LONG = b"x-padding: " + b"a" * 5000 + b"\r\n"
SCRIPTS = {
    b"/http10": [b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhello, ", b"world\n"],  # ends at the close
    b"/long": [b"HTTP/1.1 200 OK\r\n" + LONG + b"Content-Length: 2\r\n\r\nok"],
    b"/empty": [b"HTTP/1.1 204 No Content\r\n\r\n"],
    b"/reset": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"6\r\ntoken \r\n"],  # then a reset
}


def scripted_server(port: int, stop: threading.Event) -> threading.Thread:
    srv = socket.create_server(("127.0.0.1", port))
    srv.settimeout(0.2)

    def serve() -> None:
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    path = conn.recv(4096).split(b" ")[1]
                    for i, part in enumerate(SCRIPTS[path]):
                        if i:
                            time.sleep(0.02)
                        conn.sendall(part)
                    if path == b"/reset":  # SO_LINGER 0: the close sends a reset, mid-stream
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    return th


@pytest.mark.privileged
@pytest.mark.slow
def test_http10_long_headers_empty_bodies_and_resets_are_counted_never_timed_wrong(agent: tuple[Latency, int]) -> None:
    cap, port = agent
    stop = threading.Event()
    th = scripted_server(port, stop)
    try:
        for path in SCRIPTS:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    while c.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
        t = until(lambda: tenant(cap), lambda t: t.requests >= 4)
    finally:
        stop.set()
        th.join(5)
    # HTTP/1.0 and the reset stream have a first token; the 5 kB header block is too long to read; 204 has no body.
    assert (t.requests, t.headers.count, t.unpaired) == (4, 4, 0), t
    assert t.ttft.count == 2 and t.no_ttft == {"header_too_long": 1, "no_body": 1}, t
    # HTTP/1.0's body (two writes 20 ms apart) gives one gap; the reset stream's first chunk is its only token.
    assert t.inter_token.count == 1 and t.inter_token.quantile(0.5) >= 0.015, t.inter_token
    assert t.framed == 1  # the 204
