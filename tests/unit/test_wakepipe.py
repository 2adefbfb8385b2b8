"""The doorbell the loop waits on (qosagent/wakepipe.py): rung from a signal handler it ends the wait, and ringing
never blocks or raises, however often it is rung and after close."""

from __future__ import annotations

import signal
import threading
import time

from qosagent.wakepipe import WakePipe


def test_a_signal_ends_the_main_threads_wait_at_once_whichever_thread_it_reached() -> None:
    """The handler rings (as the agent's do) and the interpreter rings for the signal itself (ring_on_signals): a
    signal that reached another thread (raise_signal from the timer's) still ends the wait at once."""
    bell = WakePipe()
    handled: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda n, _f: (handled.append(n), bell.ring()))
    old_fd = bell.ring_on_signals()
    try:
        timer = threading.Timer(0.05, signal.raise_signal, (signal.SIGUSR1,))
        timer.start()
        began = time.monotonic()
        assert bell.wait(30.0)
        assert time.monotonic() - began < 20.0  # woken by the ring, not by the 30 s limit
        timer.join()
        # The interpreter marks the handler due before it rings the fd: it has run by the next bytecode here.
        assert handled == [signal.SIGUSR1]
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR1, old)
        bell.close()


def test_rung_stays_rung_until_cleared_and_ringing_a_full_or_closed_pipe_is_harmless() -> None:
    bell = WakePipe()
    assert not bell.wait(0)
    for _ in range(200_000):  # more than a pipe holds: rings past the full pipe are dropped, not blocked on
        bell.ring()
    assert bell.wait(0) and bell.wait(0)
    bell.clear()
    assert not bell.wait(0)
    bell.close()
    bell.ring()
    bell.close()
