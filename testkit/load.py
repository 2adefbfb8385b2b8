"""Paced or flooding HTTP clients, for the admission tests (tests/integration/admission_load.py) and the benchmarks,
each run as a process of its own inside the network namespace of the server it loads:

    python -m testkit.load client HOST PORT SRC THREADS PAUSE_MS SECONDS TIMEOUT_S OUT
        THREADS loops from source address SRC, each sending one GET on a new connection, then sleeping PAUSE_MS;
        stops after SECONDS, or at SIGTERM. Writes one [start (CLOCK_MONOTONIC s), latency ms, ok] per request as
        JSON to OUT.
    python -m testkit.load chat HOST PORT SRC THREADS PAUSE_MS SECONDS TIMEOUT_S OUT WORDS MAX_TOKENS
        the same loops, each request a streamed chat completion of a prompt of WORDS words (a new one each time) to
        llama-server (testkit/llamacpp.py); the latency is its time to first token.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from typing import Callable

from testkit import llamacpp


def get(host: str, port: int, src: str, timeout: float) -> float | None:
    """One GET on a new connection: its latency in s, or None when it failed."""
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout, source_address=(src, 0)) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    return time.monotonic() - t0 if data.startswith(b"HTTP/1.1 200") else None


def chat(words: int, max_tokens: int) -> Callable[[str, int, str, float], float | None]:
    """One streamed chat completion per call, each with a prompt of its own: its time to first token in s, or
    None when it failed."""
    seq = itertools.count(random.randrange(1 << 30))

    def one(host: str, port: int, src: str, timeout: float) -> float | None:
        body = llamacpp.chat(llamacpp.prompt(words, next(seq)), max_tokens)
        try:
            return llamacpp.stream_chat(host, port, body, src, timeout)
        except (OSError, http.client.HTTPException, RuntimeError):
            return None

    return one


def client(host: str, port: int, src: str, threads: int, pause_ms: float, seconds: float, timeout: float,
           out: str, request: Callable[[str, int, str, float], float | None] = get) -> None:
    deadline = time.monotonic() + seconds
    done: list[tuple[float, float, bool]] = []
    lock = threading.Lock()

    def loop() -> None:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            took = request(host, port, src, timeout)
            with lock:
                done.append((t0, (took if took is not None else time.monotonic() - t0) * 1000.0, took is not None))
            if pause_ms:
                time.sleep(pause_ms / 1000.0)

    def write(*_: object) -> None:
        with lock:
            with open(out, "w") as f:
                json.dump(done, f)
        os._exit(0)

    # SIGTERM ends the run early with what has finished (a test whose phases last as long as they take).
    signal.signal(signal.SIGTERM, write)
    ts = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + timeout + 5)
    write()


def main(argv: list[str]) -> None:
    if argv[:1] not in (["client"], ["chat"]) or len(argv) != (11 if argv[0] == "chat" else 9):
        sys.exit(__doc__)
    a = argv[1:]
    client(a[0], int(a[1]), a[2], int(a[3]), float(a[4]), float(a[5]), float(a[6]), a[7],
           chat(int(a[8]), int(a[9])) if argv[0] == "chat" else get)


if __name__ == "__main__":
    main(sys.argv[1:])
