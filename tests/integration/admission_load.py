"""Load for the admission end-to-end test: an inference-like server and paced or flooding clients.

    server PORT WORKERS SERVICE_MS         a fixed pool of WORKERS; each request holds one for SERVICE_MS, so
                                           latency grows with concurrency. The request is read as soon as the
                                           connection is accepted, so the queueing shows in what the latency
                                           probes time (first request byte read -> response sent).
    client ... / chat ...                  paced or flooding clients: testkit/load.py
Requests are bounded by time; everything runs inside the test's own network namespace.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from testkit import load

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


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        load.main(sys.argv[1:])
