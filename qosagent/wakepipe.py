"""A doorbell for a thread asleep in a wait: ring() ends the wait at once, from any thread or from a signal handler.

A pipe rather than a threading.Event: os.write takes no lock, while Event.set in a signal handler can wait for ever
on the Event's own lock, held by the very thread the handler interrupted (handlers run on the main thread, between
two of its bytecodes: inside that Event's wait or clear). The read end can also be waited on beside other fds
(selectors, poll), which an Event cannot."""

from __future__ import annotations

import os
import select
import signal
import weakref


def _close(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class WakePipe:
    def __init__(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._fds = [r, w]
        # Closed by close(), or once nothing can ring it any more (no thread, no signal handler holds its owner).
        self._closer = weakref.finalize(self, _close, self._fds)

    def fileno(self) -> int:
        """The end a wait watches (readable once rung, until clear())."""
        return self._fds[0]

    def ring(self) -> None:
        try:
            os.write(self._fds[1], b"\0")
        except BlockingIOError:
            pass  # the pipe is full of rings nobody cleared yet: rung already
        except IndexError:
            pass  # closed

    def ring_on_signals(self) -> int:
        """Rung by the interpreter itself at every signal with a Python handler (signal.set_wakeup_fd; from the main
        thread only). A handler runs on the main thread only when it next runs Python: a signal delivered to another
        thread would otherwise leave a main thread asleep in wait() until its timeout. Returns the fd rung before."""
        return signal.set_wakeup_fd(self._fds[1], warn_on_full_buffer=False)

    def wait(self, timeout: float | None) -> bool:
        """Until rung or `timeout` seconds (None: no limit); whether it was rung. The ring stays until clear()."""
        waiting = select.poll()
        waiting.register(self._fds[0], select.POLLIN)
        return bool(waiting.poll(None if timeout is None else max(0, round(timeout * 1000))))

    def clear(self) -> None:
        try:
            while os.read(self._fds[0], 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Once no thread waits on it or rings it any more (the caller's to order: a ring after close is ignored,
        one racing it could write to whatever file reuses the descriptor)."""
        self._closer()
