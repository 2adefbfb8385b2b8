"""The latency-cgroups thread (qosagent/latency/cgroupwatch.py) waits on the ring buffer's epoll fd beside a pipe of
its own: at rest it makes no pass (a 200 ms poll woke it five times a second), a record wakes it to consume, and close()
ends it at once."""

from __future__ import annotations

import os
import threading
import time

from qosagent.latency.cgroupwatch import CgroupWatch


class Ring:
    """Stands for libbpf's RingBuffer: its epoll fd is an eventfd the test writes as a record arriving would make it
    readable; consume() empties it. Every poll() or consume() is a pass of the thread."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.passes = 0
        self.consumed = threading.Event()

    def epoll_fd(self) -> int:
        return self.fd

    def poll(self, _timeout_ms: int) -> int:
        self.passes += 1
        time.sleep(_timeout_ms / 1e3)
        return 0

    def consume(self) -> int:
        self.passes += 1
        os.eventfd_read(self.fd)
        self.consumed.set()
        return 1


def test_the_watcher_sleeps_until_a_record_or_close() -> None:
    ring = Ring()
    watch = CgroupWatch(prog=None, fs=None, root="/", clock=time.monotonic)  # type: ignore[arg-type]
    watch._events = ring  # type: ignore[assignment]
    watch._start_watch()
    try:
        time.sleep(0.5)
        assert ring.passes == 0  # nothing reported: no pass
        os.eventfd_write(ring.fd, 1)  # a record
        assert ring.consumed.wait(5.0) and ring.passes == 1
        time.sleep(0.3)
        assert ring.passes == 1 and watch.errors == 0
    finally:
        thread = watch._thread
        watch.close()
        os.close(ring.fd)
    assert thread is not None and not thread.is_alive()
