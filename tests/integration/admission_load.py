"""Load for the admission end-to-end test: an inference-like server and paced or flooding clients.

    server PORT WORKERS SERVICE_MS         a fixed pool of WORKERS; each request holds one for SERVICE_MS, so
                                           latency grows with concurrency. The request is read as soon as the
                                           connection is accepted, so the queueing shows in what the latency
                                           probes time (first request byte read -> response sent).
    client HOST PORT SRC THREADS PAUSE_MS SECONDS TIMEOUT_S OUT
                                           THREADS loops from source address SRC, each sending one request,
                                           then sleeping PAUSE_MS; stops after SECONDS. Writes one
                                           [start (CLOCK_MONOTONIC s), latency ms, ok] per request as JSON to OUT.
Requests are bounded by time; everything runs inside the test's own network namespace.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"


def read_request(conn: socket.socket) -> bool:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            return False
        buf += chunk
        if len(buf) > 65536:
            return False
    return True


def server(port: int, workers: int, service_ms: float) -> None:
    pool = ThreadPoolExecutor(max_workers=workers)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", port))
    lsock.listen(1024)
    print("listening", flush=True)

    def serve(conn: socket.socket) -> None:
        try:
            time.sleep(service_ms / 1000.0)
            conn.sendall(RESPONSE)
        except OSError:
            pass
        finally:
            conn.close()

    def reader(conn: socket.socket) -> None:
        # Reading happens off the accept loop (a slow client must not stall it) but outside the pool, so the
        # wait for a worker starts after the request was read.
        try:
            conn.settimeout(10)
            if read_request(conn):
                pool.submit(serve, conn)
                return
        except OSError:
            pass
        conn.close()

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=reader, args=(conn,), daemon=True).start()


def client(host: str, port: int, src: str, threads: int, pause_ms: float, seconds: float, timeout: float,
           out: str) -> None:
    deadline = time.monotonic() + seconds
    done: list[tuple[float, float, bool]] = []
    lock = threading.Lock()
    request = f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()

    def loop() -> None:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            ok = False
            try:
                with socket.create_connection((host, port), timeout=timeout, source_address=(src, 0)) as s:
                    s.sendall(request)
                    data = b""
                    while True:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    ok = data.startswith(b"HTTP/1.1 200")
            except OSError:
                pass
            with lock:
                done.append((t0, (time.monotonic() - t0) * 1000.0, ok))
            if pause_ms:
                time.sleep(pause_ms / 1000.0)

    ts = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + timeout + 5)
    with open(out, "w") as f:
        json.dump(done, f)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        a = sys.argv[2:]
        client(a[0], int(a[1]), a[2], int(a[3]), float(a[4]), float(a[5]), float(a[6]), a[7])
