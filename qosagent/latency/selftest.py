"""Whether the latency hooks run, seen once right after they are attached.

A kernel can accept a program on a hook and never call it there: a probed function the distribution's build inlined
or bypasses, a cgroup program on a hierarchy the sockets are not in. The capability would then count nothing and
call that quiet. So, with the kernel's BPF run statistics on for that moment only (BPF_ENABLE_STATS), the agent
opens one loopback TCP connection of its own, on a port no tenant watches (its bytes are counted nowhere), sends a
request, answers it and closes; each program attached where every TCP socket passes (tracepoints, kprobes, the
cgroup2 root) must have run meanwhile. Those that did not are named in the capability's degraded verdict.

Where the statistics cannot be turned on (no CAP_SYS_ADMIN: the shipped unit and DaemonSet), ByTraffic verifies the
hooks later, from the first connections real clients open on the tracked ports and the counters the programs keep
(in sockops mode, the egress learner's failed tail calls too, which a run count would not show).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping

from qosagent.ebpf import libbpf

log = logging.getLogger("qosagent.latency")

REQUEST = b"GET /qosagent-self-test HTTP/1.1\r\nHost: localhost\r\n\r\n"
RESPONSE = b"HTTP/1.1 204 No Content\r\n\r\n"
SETTLE_S = 1.0  # how long counts may take to show (they are written in the syscalls themselves: at once, in practice)


def loopback_exchange(avoid: Collection[int]) -> None:
    """One request and its response over a fresh loopback connection, on an ephemeral port outside `avoid`."""
    with _listener(avoid) as srv:
        srv.listen(1)
        srv.settimeout(5)
        with socket.create_connection(srv.getsockname(), timeout=5) as cli:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(5)
                cli.sendall(REQUEST)
                _recv_exactly(conn, len(REQUEST))
                conn.sendall(RESPONSE)
                _recv_exactly(cli, len(RESPONSE))


def _listener(avoid: Collection[int]) -> socket.socket:
    for _ in range(16):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        if s.getsockname()[1] not in avoid:
            return s
        s.close()
    raise OSError("no ephemeral port outside the watched ones")


def _recv_exactly(s: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        chunk = s.recv(n - got)
        if not chunk:
            raise OSError("the self-test's connection closed early")
        got += len(chunk)


class Unverifiable(Exception):
    """The kernel's run statistics cannot be turned on here: BPF_ENABLE_STATS needs CAP_SYS_ADMIN, which the
    least-privilege unit does not grant, and kernels before 5.8 lack it. Nothing is known either way."""


def check(programs: Mapping[str, int], avoid: Collection[int] = (),
          traffic: Callable[[Collection[int]], None] = loopback_exchange,
          run_count: Callable[[int], int] = libbpf.prog_run_count,
          enable_stats: Callable[[], int] = libbpf.enable_stats,
          unread: Callable[[], int] | None = None) -> str | None:
    """programs: name -> fd of the programs that every TCP socket's traffic must run. None when each ran during
    the self-test's exchange, else the reason (for the capability's verdict); Unverifiable when the run statistics
    cannot be had. unread (sockops mode): the packets the egress learner could not tail-call lat_egress for; the
    kernel counts the learner's runs whether or not its tail call ran, so a run count alone passes an empty slot."""
    if not programs:
        return None
    try:
        stats = enable_stats()
    except OSError as e:
        raise Unverifiable(f"hooks not verified at start (BPF run statistics: {e.strerror})") from None
    try:
        return _exchange(programs, avoid, traffic, run_count, unread)
    except OSError as e:  # a map or program read refused: never expected, and no reason to leave start half done
        return f"self-test: the programs' counts could not be read ({e}): hooks not seen firing"
    finally:
        os.close(stats)


def _exchange(programs: Mapping[str, int], avoid: Collection[int], traffic: Callable[[Collection[int]], None],
              run_count: Callable[[int], int], unread: Callable[[], int] | None) -> str | None:
    """check()'s exchange, with the statistics on; the reads' OSError is check()'s to say."""
    unread_before = unread() if unread is not None else 0
    before = {name: run_count(fd) for name, fd in programs.items()}
    try:
        traffic(avoid)
    except OSError as e:
        return f"self-test's loopback connection failed ({e}): hooks not seen firing"
    end = time.monotonic() + SETTLE_S
    while True:
        silent = sorted(name for name, fd in programs.items() if run_count(fd) <= before[name])
        if not silent or time.monotonic() >= end:
            break
        time.sleep(0.05)
    lost = unread() - unread_before if unread is not None else 0
    if lost:
        return f"self-test: {tail_calls_failed(lost, 'during the self-test')}"
    if silent:
        return (f"self-test: {', '.join(silent)} did not run for a loopback connection of the agent's own: "
                "requests there would go uncounted")
    log.info("latency self-test: %d hooks ran for a loopback connection of the agent's own", len(programs))
    return None


def tail_calls_failed(packets: int, when: str) -> str:
    """The reason where the egress learner's unread count (a host-wide counter: every packet the learner saw) moved,
    whether the self-test or real traffic (ByTraffic) saw it."""
    return (f"lat_egress_learn's tail call to lat_egress failed for {packets} packets {when}: responses would go "
            "unread, their time to first token and inter-token latency lost")


@dataclass(frozen=True)
class Seen:
    """What ByTraffic.observe found: `verified` (the programs counted traffic, and no tail call of the learner was
    seen failing) or not (they counted none of what came, or a tail call failed), with the reason for the verdict;
    None from observe while nothing changed."""

    verified: bool
    reason: str


class ByTraffic:
    """The hooks verified from real traffic, where the self-test could not run. The programs count every connection
    they track on a tracked port and every request they see start there (lat_count: LAT_C_CONNS, LAT_C_STARTED), so a
    connection on a tracked port that was not open at start must move the count. Verified once the count moved; silent
    when new connections came on those ports for `within` seconds and it did not (a silent agent is verified again
    once it moves). In sockops mode (unread given) the egress learner's failed tail calls are watched too, since the
    count moves whether or not they fail: once that count moved the verdict is lost for good (`lost`), whatever the
    other count does. Pure: the capability passes the counts and the connections it lists."""

    def __init__(self, counted: int, open_now: Collection[bytes], unread: int | None = None):
        self._counted = counted  # at start
        self._known = set(open_now)  # open at start: adopted, counted only at their next request
        self._unread = unread  # sockops mode: the learner's failed tail calls at start; None where not watched
        self._said = ""  # what the count showed last: verified or silent
        self.traffic_since: float | None = None  # when the first new connection on a tracked port was seen
        self.silent = False
        self.verified = False
        self.lost: str | None = None  # why responses go unread, once the learner's tail calls were seen failing

    @property
    def done(self) -> bool:
        """Nothing more can change the verdict: the tail calls were seen failing, or the hooks verified where the
        tail calls are not watched."""
        return self.lost is not None or (self.verified and self._unread is None)

    def observe(self, now: float, wall: float, counted: int, open_now: Collection[bytes] | None,
                within: float, unread: int = 0) -> Seen | None:
        """now: monotonic seconds; wall: time.time() for the message; open_now: the connections open on the tracked
        ports, or None when they were not listed this time (the count alone can still verify); unread: the learner's
        failed tail calls as of now (sockops mode). The verdict whenever it changed, else None."""
        lost = self._unread is not None and self.lost is None and unread > self._unread
        if lost:
            assert self._unread is not None
            self.lost = tail_calls_failed(unread - self._unread, "since start")
        if not self._counts(now, wall, counted, open_now, within) and not lost:
            return None
        return Seen(self.verified and self.lost is None, "; ".join(r for r in (self._said, self.lost) if r))

    def _counts(self, now: float, wall: float, counted: int, open_now: Collection[bytes] | None,
                within: float) -> bool:
        """Whether what the programs counted changed what is known of them (self._said)."""
        if self.verified:
            return False
        if counted > self._counted:
            self.silent, self.verified = False, True
            n = counted - self._counted
            self._said = f"hooks verified at {_utc(wall)} by traffic ({n} connections and requests counted)"
            return True
        if open_now is not None and self.traffic_since is None and set(open_now) - self._known:
            self.traffic_since = now
        if self.silent or self.traffic_since is None or now - self.traffic_since < within:
            return False
        self.silent = True
        self._said = (f"hooks not seen running: connections came on the tracked ports for {within:g} s "
                      "and no program counted one (requests there go uncounted)")
        return True


def _utc(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
