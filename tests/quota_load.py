"""Run inside test network namespaces: `serve PORT...` (HTTP/1.1 keep-alive server) or `load ...` (client threads
from one source address, JSON result on stdout). Loops are bounded by time and count."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY = b"x" * 2000  # more than one segment's worth would hide nothing; 2 kB checks completeness cheaply


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *_a: object) -> None:
        pass


def serve(addr: str, ports: list[int]) -> None:
    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256
        address_family = __import__("socket").AF_INET6 if ":" in addr else __import__("socket").AF_INET

    servers = [Server((addr, p), Handler) for p in ports]
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print("ready", flush=True)
    servers[0].serve_forever()


def load(a: argparse.Namespace) -> None:
    done: list[tuple[float, float]] = []  # (finish time, latency)
    errors: list[str] = []
    lock = threading.Lock()
    start = time.time() + a.delay
    end = start + a.duration
    headers = dict(h.split(":", 1) for h in a.header)

    def worker() -> None:
        conn = None
        n = 0
        while time.time() < end and n < a.max_requests:
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(a.host, a.port, timeout=a.timeout, source_address=(a.src, 0))
                t0 = time.time()
                conn.request("GET", "/", headers={k.strip(): v.strip() for k, v in headers.items()})
                resp = conn.getresponse()
                body = resp.read()
                t1 = time.time()
                if resp.status != 200 or body != BODY:
                    raise OSError(f"status {resp.status}, {len(body)} bytes")
                with lock:
                    done.append((t1, t1 - t0))
                n += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported to the test
                with lock:
                    errors.append(repr(e))
                if conn is not None:
                    conn.close()
                conn = None
            if a.pause:
                time.sleep(a.pause)
        if conn is not None:
            conn.close()

    while time.time() < start:
        time.sleep(0.01)
    threads = [threading.Thread(target=worker) for _ in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    json.dump({"start": start, "end": end, "done": done, "errors": errors}, sys.stdout)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("addr")
    s.add_argument("ports", type=int, nargs="+")
    c = sub.add_parser("load")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--src", required=True)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--duration", type=float, default=5.0)
    c.add_argument("--delay", type=float, default=0.0)
    c.add_argument("--pause", type=float, default=0.0)
    c.add_argument("--timeout", type=float, default=30.0)
    c.add_argument("--max-requests", type=int, default=100000)
    c.add_argument("--header", action="append", default=[])
    a = p.parse_args()
    if a.cmd == "serve":
        serve(a.addr, a.ports)
    else:
        load(a)


if __name__ == "__main__":
    main()
