"""A CPU-bound inference-like server for the resources loop test: PROCS pre-forked processes share one listening
socket; each request burns BURN_MS of CPU, then answers. Runs where the test put it (its cgroup, its CPUs).

    python resources_load.py PORT PROCS BURN_MS
"""

from __future__ import annotations

import os
import socket
import sys
import time

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"


def burn(ms: float) -> None:
    """CPU time, not wall time: a process the scheduler holds back takes longer to finish."""
    end = time.thread_time() + ms / 1000.0
    x = 0
    while time.thread_time() < end:
        for _ in range(200):
            x += 1


def serve(lsock: socket.socket, burn_ms: float) -> None:
    while True:
        conn, _ = lsock.accept()
        try:
            conn.settimeout(10)
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                buf += chunk
            if b"\r\n\r\n" in buf:
                burn(burn_ms)
                conn.sendall(RESPONSE)
        except OSError:
            pass
        finally:
            conn.close()


def main(port: int, procs: int, burn_ms: float) -> None:
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", port))
    lsock.listen(1024)
    for _ in range(procs - 1):
        if os.fork() == 0:
            serve(lsock, burn_ms)
    print("listening", flush=True)
    serve(lsock, burn_ms)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
