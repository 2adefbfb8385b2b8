"""Loopback HTTP servers and ports for the latency tests."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from typing import Any, Callable, Iterator

from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.features import ensure_mounted, probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency


def until(what: Callable[[], Any], done: Callable[[Any], bool] = bool, timeout: float = 10.0) -> Any:
    """what() once done() says so of it, polled; at the timeout its last value, for the assertion's message."""
    end = time.monotonic() + timeout
    while True:
        got = what()
        if done(got) or time.monotonic() > end:
            return got
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(ports: tuple[int, ...], handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[None]:
    """Threaded HTTP servers on 127.0.0.1 at `ports`, shut down and closed on exit even when the test fails."""
    started = []
    try:
        for port in ports:
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            started.append(srv)
        yield
    finally:
        for srv in started:
            srv.shutdown()
            srv.server_close()


@contextlib.contextmanager
def latency_capability(mode: str, port: int, tenants: list[dict[str, Any]]) -> Iterator[Latency]:
    """The latency capability alone, in the given mode, timing the server on port (run queue off), stopped after."""
    fs = HostFS("/")
    ensure_mounted(fs)
    cfg = parse({"tenants": tenants, "latency": {"mode": mode, "ports": [port], "runqueue": {"enabled": False}}},
                "test")
    cap = Latency(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is State.ACTIVE and verdict.plan.egress, verdict.reason
    cap.start(verdict.plan)
    try:
        yield cap
    finally:
        cap.stop()


def close_to(measured: float | None, client: float, rel: float = 0.10, floor: float = 0.005) -> bool:
    """Within rel of the client's value or floor seconds, whichever is larger (the latency tests' tolerance)."""
    return measured is not None and abs(measured - client) <= max(rel * client, floor)
