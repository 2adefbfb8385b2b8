"""The demo's traffic: a small streaming, inference-like HTTP server and an open-loop client per tenant.

serve: every GET holds a "prefill" delay, then streams tokens as server-sent events with a delay per token, so
time to first byte and full response time differ the way they do for an LLM server.
load: opens a new connection per request at a fixed rate for a fixed time (both bounded) and prints what the
client saw, to set beside what the agent measured in the kernel; with --chat each request is a streamed chat
completion, for llama-server (the real engine the demo runs where it is built).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Completion(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    prefill_s = 0.03
    token_s = 0.004
    tokens = 16

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        time.sleep(self.prefill_s)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(self.tokens):
            self._chunk(f"data: token{i}\n\n".encode())
            time.sleep(self.token_s)
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, *_args: object) -> None:
        pass


def serve(ports: list[int]) -> None:
    servers = []
    for port in ports:
        srv = ThreadingHTTPServer(("127.0.0.1", port), Completion)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    print(f"serving on {', '.join(map(str, ports))}", flush=True)
    threading.Event().wait()


# A streamed chat completion of 16 tokens, for llama-server (the demo runs it when it is built, scripts/demo.sh).
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16,
                   "stream": True}).encode()


def one_request(port: int, source: str, timeout: float, chat: bool = False) -> tuple[float, float] | str:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        if chat:
            conn.request("POST", "/v1/chat/completions", body=CHAT, headers={"Content-Type": "application/json"})
        else:
            conn.request("GET", "/v1/completions")
        r = conn.getresponse()
        r.read(1)
        ttfb = time.monotonic() - t0
        r.read()
        return ttfb, time.monotonic() - t0
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        conn.close()


def load(name: str, port: int, source: str, rps: float, duration: float, timeout: float, chat: bool) -> None:
    results: list[tuple[float, float] | str] = []
    lock = threading.Lock()
    threads = []

    def run() -> None:
        r = one_request(port, source, timeout, chat)
        with lock:
            results.append(r)

    start = time.monotonic()
    n = int(rps * duration)
    for i in range(n):
        delay = start + i / rps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout + 1)
    ok = [r for r in results if isinstance(r, tuple)]
    failed = len(results) - len(ok)
    slow = sum(1 for r in ok if r[1] > 0.5)
    line = (f"{name:<6} client: {n} sent at {rps:g}/s over {duration:g}s, {len(ok)} answered, {failed} gave up "
            f"after {timeout:g}s")
    if ok:
        ttfb = sorted(r[0] for r in ok)
        resp = sorted(r[1] for r in ok)
        q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
        line += (f"; TTFB p50 {statistics.median(ttfb) * 1e3:.0f} ms p99 {q(ttfb, .99) * 1e3:.0f} ms, "
                 f"response p50 {statistics.median(resp) * 1e3:.0f} ms p99 {q(resp, .99) * 1e3:.0f} ms, "
                 f"{slow} took over 500 ms (a request dropped at the quota is retransmitted by TCP, later)")
    print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("ports", type=int, nargs="+")
    lo = sub.add_parser("load")
    lo.add_argument("--name", required=True)
    lo.add_argument("--port", type=int, required=True)
    lo.add_argument("--source", default="127.0.0.1")
    lo.add_argument("--rps", type=float, required=True)
    lo.add_argument("--duration", type=float, default=10.0)
    lo.add_argument("--timeout", type=float, default=3.0)
    lo.add_argument("--chat", action="store_true", help="POST streamed chat completions (to llama-server)")
    a = p.parse_args()
    if a.cmd == "serve":
        serve(a.ports)
    else:
        if not (0 < a.rps <= 500 and 0 < a.duration <= 120):
            sys.exit("load: expected 0 < rps <= 500 and 0 < duration <= 120 s")
        load(a.name, a.port, a.source, a.rps, a.duration, a.timeout, a.chat)


if __name__ == "__main__":
    main()
