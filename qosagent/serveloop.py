"""The accept loop of the agent's socket servers (the status socket, the HTTP listeners): a thread that sleeps until a
client connects or stop() is called. socketserver's serve_forever wakes every poll_interval (0.5 s) to look for a
shutdown(): twice a second per server on an idle agent, for nothing."""

from __future__ import annotations

import selectors
import socketserver
import threading

from qosagent.wakepipe import WakePipe


class ServeLoop:
    """server's requests handled as they come, in a thread named name, until stop(). One run: once stopped, it
    does not serve again (a server to serve again takes a new ServeLoop)."""

    def __init__(self, server: socketserver.BaseServer, name: str):
        self.server = server
        self._stopping = False
        self._wake: WakePipe | None = WakePipe()  # stop() rings it: the wait ends at once
        self._lock = threading.Lock()  # orders start() and stop(), and one stop() against another
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        """Serve from now on; RuntimeError after stop(), whose pipe is gone (the thread would die at once while the
        caller believed it served)."""
        with self._lock:
            if self._stopping:
                raise RuntimeError(f"{self.thread.name}: start() after stop(); a stopped ServeLoop does not serve "
                                   "again")
            self.thread.start()

    def _serve(self) -> None:
        assert self._wake is not None
        with selectors.DefaultSelector() as waiting:
            waiting.register(self.server, selectors.EVENT_READ)
            waiting.register(self._wake, selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in waiting.select():
                    if key.fileobj is self.server and not self._stopping:
                        # Accept and hand the request to the server's own handling (a thread per request for the
                        # Threading servers), as serve_forever does; its errors go to server.handle_error.
                        self.server._handle_request_noblock()

    def stop(self) -> None:
        """End the loop and wait for it; safe before start() and twice. The server's socket stays the caller's to
        close (server_close). Under the lock: a second stop() meanwhile waits for the first and finds nothing to do,
        rather than ringing a pipe already closed (by then, maybe fds someone else opened)."""
        with self._lock:
            self._stopping = True
            if self._wake is None:
                return
            self._wake.ring()
            if self.thread.is_alive():
                self.thread.join()  # the loop takes no lock: it ends holding none
            self._wake.close()
            self._wake = None
