"""Loopback HTTP servers and ports for the latency tests."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from typing import Any, Callable, Iterator


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
