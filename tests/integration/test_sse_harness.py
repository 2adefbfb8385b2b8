"""The latency tests' streaming server and clients (sse_server.py, sse_client.py) measure what they claim.

Unprivileged, loopback only, a few seconds. Each request is held to what causality guarantees (token k cannot
reach the client before prefill + k * token after the request started); what noise can spoil (how late) is held
to on medians, loosely: on a busy 2-CPU machine the server and the client wait for CPUs (seen: +16 ms on a median,
180 ms on one request, with a VM running beside them).
"""

from __future__ import annotations

import json
import math
import random
import signal
import socket
import statistics
import subprocess
import sys
from typing import Iterator

import pytest

from tests.conftest import REPO
from testkit.sse_client import (Timing, aiohttp_requests, disconnect_before_first_token,
                                          expect_continue_request, httpx_requests, percentile, pipelined_requests,
                                          split_body_request)
from tests.integration.latency_helpers import until
from testkit.sse_server import Server, sse_server

PREFILL, TOKEN, TOKENS = 0.040, 0.015, 5
EARLY = 0.002  # how early a timer of uvloop's (millisecond resolution) may fire
LATE = 0.025  # how late a median may be
STREAM = {"stream": True}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with sse_server(prefill_ms=PREFILL * 1000, token_ms=TOKEN * 1000, tokens=TOKENS) as s:
        yield s


def check_stream(t: Timing, prefill: float = PREFILL, tokens: int = TOKENS) -> None:
    assert t.status == 200 and t.done
    assert len(t.tokens) == tokens
    for k, at in enumerate(t.tokens):
        assert at - t.start >= prefill + k * TOKEN - (k + 1) * EARLY, (k, t)
    assert t.headers <= t.chunks[0] == t.tokens[0] and t.end >= t.tokens[-1]


def check_medians(timings: list[Timing], prefill: float = PREFILL) -> None:
    assert statistics.median(t.ttft for t in timings) < prefill + LATE
    assert TOKEN - EARLY < statistics.median(g for t in timings for g in t.gaps) < TOKEN + LATE / 2


@pytest.mark.parametrize("client", [httpx_requests, aiohttp_requests])
def test_pooled_clients_see_the_prefill_and_token_delays(server: Server, client) -> None:
    timings = client(server.url, [STREAM] * 8, concurrency=4)
    for t in timings:
        check_stream(t)
    check_medians(timings)
    # uvicorn writes the headers when the handler returns: the client has them a prefill before the first token.
    assert statistics.median(t.ttft - t.ttfb for t in timings) > PREFILL / 2
    # Keep-alive: eight requests on at most four connections.
    assert 0 not in {t.local_port for t in timings}
    assert len({t.local_port for t in timings}) <= 4


def test_per_request_delays_follow_a_drawn_distribution(server: Server) -> None:
    rng = random.Random(13)
    prefills = [rng.lognormvariate(math.log(45), 0.2) / 1000 for _ in range(12)]
    timings = httpx_requests(server.url, [{"stream": True, "prefill_ms": p * 1000} for p in prefills], concurrency=4)
    for t, p in zip(timings, prefills):
        check_stream(t, p)
    assert statistics.median(t.ttft - p for t, p in zip(timings, prefills)) < LATE


def test_non_streaming_answer_comes_whole_after_the_generation(server: Server) -> None:
    [t] = httpx_requests(server.url, [{"stream": False}], concurrency=1)
    assert t.status == 200 and not t.tokens
    assert json.loads(t.body)["usage"]["completion_tokens"] == TOKENS
    assert t.ttfb >= PREFILL + (TOKENS - 1) * TOKEN - TOKENS * EARLY


def test_no_content(server: Server) -> None:
    [t] = httpx_requests(server.url, [{}], concurrency=1, path="/v1/empty")
    assert t.status == 204 and not t.chunks and t.body == b""


def test_raw_socket_clients(server: Server) -> None:
    check_stream(split_body_request(server.port, STREAM))

    t = expect_continue_request(server.port, STREAM)
    check_stream(t)
    assert [status for status, _ in t.interim] == [100] and t.interim[0][1] <= t.headers

    first, second = pipelined_requests(server.port, STREAM, {"stream": True, "tokens": 2})
    check_stream(first)
    check_stream(second, tokens=2)
    assert first.local_port == second.local_port and second.headers >= first.end

    # A long prefill: the client has its headers (and hangs up) well before the first token, however busy the CPUs.
    gone = disconnect_before_first_token(server.port, {"prefill_ms": 300})
    assert gone.status == 200 and not gone.chunks
    # The server took the hang-up in its stride.
    check_stream(httpx_requests(server.url, [STREAM], concurrency=1)[0])


def test_single_write_server_sends_headers_with_the_first_token() -> None:
    with sse_server("single-write", prefill_ms=PREFILL * 1000, token_ms=TOKEN * 1000, tokens=TOKENS) as s:
        timings = httpx_requests(s.url, [STREAM] * 3, concurrency=1)
    for t in timings:
        check_stream(t)
        # One segment, one read: the client parses the first token right after the headers.
        assert t.ttft - t.ttfb < 0.005
    check_medians(timings)
    assert len({t.local_port for t in timings}) == 1


def gone(pid: int) -> bool:
    """No such process, or a zombie (an orphan is reaped by whatever is pid 1 here, maybe never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_server_is_killed_when_the_test_fails() -> None:
    with pytest.raises(RuntimeError, match="test failed"):
        with sse_server() as s:
            raise RuntimeError("test failed")
    assert gone(s.pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s.port), timeout=1)


def test_server_dies_with_a_killed_test_process() -> None:
    code = ("import sys, time; from testkit.sse_server import sse_server\n"
            "with sse_server() as s:\n    print(s.pid, flush=True)\n    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert until(lambda: gone(pid), timeout=5)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert [percentile(values, q) for q in (0.1, 0.5, 0.9, 0.95, 1.0)] == [1.0, 5.0, 9.0, 10.0, 10.0]
