"""The agent on this kernel, end to end: how long until it is ready, and whether it counts real requests.

    python -m tests.vm.agent_ready [--mode MODE] [--runs N] [--requests N] [--idle N]

Each run starts `qosagent run` on the issue's example config (latency.mode MODE), measures the time from the
start of the process to /readyz answering 200, sends --requests GETs on fresh connections to a tenant's port
(a server answering after 20 ms) while --idle other connections sit in a blocking read on an unwatched port (as a
host's other services do), then prints one JSON line: ready seconds, requests and connections the agent counted,
and its latency verdict. Used by the kernel matrix (tests/vm/test_kernel_matrix.py) and by hand in the VM.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from qosagent.status import request
from tests.integration.latency_helpers import free_port, serving, until
from tests.integration.test_latency_agent import EXAMPLE, AgentProc

PORT = 18001
IDLE_PORT = 18999  # not watched


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(0.020)
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *_: Any) -> None:
        pass


def one_run(mode: str, requests: int, idle: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, serving((PORT, IDLE_PORT), Handler):
        idlers: list[socket.socket] = []
        t0 = time.monotonic()
        agent = AgentProc(Path(tmp), EXAMPLE + f"latency:\n  mode: {mode}\n")
        try:
            agent.start(timeout=600)
            ready_s = time.monotonic() - t0
            # Connections whose server threads block in a read, entered after the probes are attached.
            idlers += [socket.create_connection(("127.0.0.1", IDLE_PORT)) for _ in range(idle)]
            time.sleep(0.5 if idle else 0)
            for _ in range(requests):
                c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
                c.request("GET", "/")
                c.getresponse().read()
                c.close()

            # The status socket in-process, not `qosagent status`: a Python start takes tens of seconds emulated.
            def status() -> dict[str, Any]:
                return request(agent.socket, {"cmd": "status"}, timeout=60)

            def acme() -> dict[str, Any]:
                return next((t for t in status()["latency"]["tenants"] if t["tenant"] == "acme"), {})

            row = until(acme, lambda r: r.get("requests") == requests, timeout=10)
            st = status()
            verdict = {k: st.get("capabilities", {}).get("latency", {}).get(k) for k in ("state", "reason")}
            with urllib.request.urlopen(agent.url("/metrics"), timeout=10) as r:
                text = r.read().decode()
            conns = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("qosagent_latency_connections_total{") and 'tenant="acme"' in line)
            return {"mode": mode, "ready_s": round(ready_s, 1), "requests_sent": requests,
                    "requests_counted": row.get("requests", 0), "connections_counted": conns,
                    "headers_p50": (row.get("headers_total") or {}).get("p50"), "idle_connections": idle,
                    "verdict": verdict}
        finally:
            agent.stop()
            for s in idlers:
                s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.vm.agent_ready")
    p.add_argument("--mode", default="auto")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--idle", type=int, default=0)
    a = p.parse_args(argv)
    free_port()  # the helpers import cleanly: fail here, not halfway through a run
    bad = 0
    for _ in range(a.runs):
        r = one_run(a.mode, a.requests, a.idle)
        print("agent_ready " + json.dumps(r), flush=True)
        bad += r["requests_counted"] != a.requests
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
