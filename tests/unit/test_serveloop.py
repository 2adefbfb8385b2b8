"""The socket servers' accept loop (qosagent/serveloop.py): it makes no pass while no client comes (serve_forever woke
twice a second to look for a shutdown), serves each client that does, and stop() ends it at once, once however
many call it; a stopped loop refuses to start again."""

from __future__ import annotations

import os
import selectors
import socket
import socketserver
import threading

import pytest

from qosagent import serveloop, wakepipe
from qosagent.serveloop import ServeLoop


class Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.wfile.write(self.rfile.readline())


class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    passes = 0

    def _handle_request_noblock(self) -> None:
        self.passes += 1
        super()._handle_request_noblock()


def ask(path: str, line: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(line)
        return s.makefile("rb").readline()


def test_the_loop_sleeps_until_a_client_or_stop(tmp_path, monkeypatch) -> None:
    waits = []

    class Selector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        def select(self, timeout=None):  # type: ignore[no-untyped-def]
            waits.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(serveloop.selectors, "DefaultSelector", Selector)
    path = str(tmp_path / "s.sock")
    server = Server(path, Echo)
    loop = ServeLoop(server, "test")
    loop.start()
    try:
        assert not threading.Event().wait(0.6)  # longer than serve_forever's poll interval
        assert waits == [None] and server.passes == 0  # one wait, with no timeout
        assert ask(path, b"one\n") == b"one\n" and ask(path, b"two\n") == b"two\n"
        assert server.passes == 2
    finally:
        loop.stop()
        server.server_close()
    assert not loop.thread.is_alive()
    loop.stop()  # twice: nothing left to do


def test_stop_before_start_is_safe(tmp_path) -> None:
    server = Server(str(tmp_path / "s.sock"), Echo)
    loop = ServeLoop(server, "test")
    loop.stop()
    server.server_close()
    assert not loop.thread.is_alive()


def test_start_after_stop_raises_and_serves_nothing(tmp_path) -> None:
    server = Server(str(tmp_path / "s.sock"), Echo)
    loop = ServeLoop(server, "test")
    loop.start()
    loop.stop()
    with pytest.raises(RuntimeError, match="start\\(\\) after stop\\(\\)"):
        loop.start()
    never = ServeLoop(server, "never")
    never.stop()
    with pytest.raises(RuntimeError, match="never: start\\(\\) after stop\\(\\)"):
        never.start()
    assert not never.thread.is_alive() and never.thread.ident is None  # no thread left to die
    server.server_close()


def test_concurrent_stops_close_the_pipe_once(tmp_path, monkeypatch) -> None:
    """Eight stop() at once: each of the pipe's fds closed once. The first stop's ring waits until every
    caller has entered stop(), so without the lock the others would pass its 'nothing left' check meanwhile."""
    callers = 8
    entered = threading.Semaphore(0)
    all_in = threading.Event()
    closed: list[int] = []
    real_write, real_close = os.write, os.close

    def write(fd: int, data: bytes) -> int:
        all_in.wait(2.0)
        return real_write(fd, data)

    def close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    server = Server(str(tmp_path / "s.sock"), Echo)
    loop = ServeLoop(server, "test")
    assert loop._wake is not None
    wake = list(loop._wake._fds)
    loop.start()
    monkeypatch.setattr(wakepipe.os, "write", write)
    monkeypatch.setattr(wakepipe.os, "close", close)
    barrier = threading.Barrier(callers)
    errors: list[BaseException] = []

    def stop() -> None:
        barrier.wait()
        entered.release()
        try:
            loop.stop()
        except BaseException as e:  # noqa: BLE001 - an EBADF of a second close is what this looks for
            errors.append(e)

    stoppers = [threading.Thread(target=stop) for _ in range(callers)]
    for t in stoppers:
        t.start()
    for _ in range(callers):
        entered.acquire()
    all_in.set()
    for t in stoppers:
        t.join(10.0)
    monkeypatch.undo()
    server.server_close()
    assert errors == []
    assert sorted(closed) == sorted(wake)  # each once
    assert not loop.thread.is_alive()
