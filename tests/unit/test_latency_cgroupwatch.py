"""The latency-cgroups thread (qosagent/latency/cgroupwatch.py) waits on the ring buffer's epoll fd beside a pipe of
its own: at rest it makes no pass (a 200 ms poll woke it five times a second), a record wakes it to consume, and close()
ends it at once. With a libbpf that has no ring_buffer__epoll_fd it falls back to libbpf's own poll, with a timeout:
records still reach the linker, and close() ends it within the poll under way."""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import time

import pytest

from qosagent.ebpf.libbpf import LibbpfMissing
from qosagent.latency.cgroupwatch import FALLBACK_POLL_MS, CgroupEvent, CgroupWatch


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


class OldLibbpfRing:
    """A ring of a libbpf without ring_buffer__epoll_fd (< 0.3): epoll_fd() raises what libbpf.call raises for a
    missing symbol, and poll(timeout) waits for a record itself (an eventfd the test writes), handing each to
    on_sample as libbpf does. Counts its polls, and those begun after close() asked the thread to stop."""

    def __init__(self, watch: CgroupWatch) -> None:
        self.watch = watch
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.polls = 0
        self.polls_after_stop = 0
        self.polled = threading.Event()

    def epoll_fd(self) -> int:
        raise LibbpfMissing("ring_buffer__epoll_fd is not in this libbpf (an older one); install libbpf1 (1.x) for it")

    def poll(self, timeout_ms: int) -> int:
        self.polls += 1
        if self.watch._stopping.is_set():
            self.polls_after_stop += 1
        self.polled.set()
        readable, _, _ = select.select([self.fd], [], [], timeout_ms / 1e3)
        if not readable:
            return 0
        for _ in range(os.eventfd_read(self.fd)):
            ev = CgroupEvent(id=4242, tgid=77)
            self.watch._on_event(ctypes.addressof(ev), ctypes.sizeof(ev))
        return 1

    def consume(self) -> int:
        raise AssertionError("the fallback polls; it has no epoll fd to have seen a record on")


def test_without_an_epoll_fd_the_watcher_polls_delivers_and_stops(caplog: pytest.LogCaptureFixture) -> None:
    watch = CgroupWatch(prog=None, fs=None, root="/", clock=time.monotonic)  # type: ignore[arg-type]
    ring = OldLibbpfRing(watch)
    linked: list[tuple[int, int]] = []
    delivered = threading.Event()

    def link(cgid: int, tgid: int, path: str | None = None) -> None:
        linked.append((cgid, tgid))
        delivered.set()

    watch.link = link  # type: ignore[method-assign]
    watch._events = ring  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="qosagent.latency"):
        watch._start_watch()
        try:
            assert ring.polled.wait(5.0)
            os.eventfd_write(ring.fd, 2)  # two records
            assert delivered.wait(5.0)
            while len(linked) < 2 and ring.polls < 100:
                ring.polled.clear()
                ring.polled.wait(5.0)
            assert linked == [(4242, 77), (4242, 77)]
            assert watch.errors == 0
            ring.polled.clear()
            assert ring.polled.wait(5.0)  # the thread is inside a poll as close() comes
        finally:
            thread = watch._thread
            watch.close()
            os.close(ring.fd)
    assert thread is not None and not thread.is_alive()
    # Stopped at the end of the poll under way when close() came (within FALLBACK_POLL_MS): no poll began after it.
    assert ring.polls_after_stop == 0
    assert [r for r in caplog.records if f"{FALLBACK_POLL_MS} ms polls" in r.getMessage()]
