"""The socket servers' accept loop (qosagent/serveloop.py): it makes no pass while no client comes (serve_forever woke
twice a second to look for a shutdown), serves each client that does, and stop() ends it at once."""

from __future__ import annotations

import selectors
import socket
import socketserver
import threading

from qosagent import serveloop
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
