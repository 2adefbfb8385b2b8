"""Reading the servers' metrics off the tick thread: one background thread, reads bounded by a deadline from
connect to last byte, results kept for collect() to copy into the Snapshot.

The tick never waits on a server. A read that fails keeps the last good reading only until it is stale_after
old; after that the server is unknown, with the last failure as the reason.
"""

from __future__ import annotations

import collections
import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable

from qosagent.hostfs import HostFS
from qosagent.servers import discovery, kinds
from qosagent.servers.config import ServerConfig
from qosagent.servers.kinds import GENERATED, KV, PREEMPTIONS, RUNNING, WAITING
from qosagent.servers.model import ServerReading, ServersPart
from qosagent.servers.parse import ExpositionError, Parsed, parse

log = logging.getLogger("qosagent.servers")

MAX_BODY = 32 << 20  # a vLLM exposition with every histogram is a few hundred KiB
DISCOVER_EVERY = 10.0  # seconds between walks of /proc (ports, owners, process tree)
ROUND_S = 0.05  # the least time between two passes of the reading thread

NOT_A_SERVER = ("not read: its command line names no vllm, sglang, tgi, triton or llama-server server; list it "
                "under servers: to read it")

# Read results: the values of the metric label `result` (docs/servers.md).
OK, DOWN, TIMEOUT, HTTP_ERROR, GARBAGE, TOO_LARGE = "ok", "down", "timeout", "http_error", "garbage", "too_large"
# Nothing listens on the server's port: the process is gone (crashed, stopped), so nothing it last reported holds.
REFUSED = "connection refused"


class FetchError(Exception):
    def __init__(self, result: str, reason: str, status: int | None = None):
        super().__init__(reason)
        self.result = result
        self.status = status  # the HTTP status of an http_error answer


def fetch(url: str, timeout: float) -> str:
    """The body of a GET, within timeout from connect to last byte (a server that trickles is cut off too)."""
    u = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname or "127.0.0.1", u.port, timeout=timeout)

    def left() -> float:
        rest = deadline - time.monotonic()
        if rest <= 0:
            raise FetchError(TIMEOUT, f"no complete answer within {timeout:g}s")
        return rest

    try:
        conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""),
                     headers={"Accept": "text/plain;version=0.0.4"})
        # Kept here: http.client drops conn.sock once a Connection: close response is under way.
        sock = conn.sock
        assert sock is not None
        sock.settimeout(left())
        resp = conn.getresponse()
        if resp.status != 200:
            raise FetchError(HTTP_ERROR, f"HTTP {resp.status} {resp.reason}".strip(), resp.status)
        body = bytearray()
        while True:
            sock.settimeout(left())
            chunk = resp.read1(65536)
            if not chunk:
                if resp.length:
                    # Closed before the Content-Length it announced (a server that died mid-answer): the last
                    # line may end inside a number, so none of it is read (a chunked answer raises the same).
                    raise http.client.IncompleteRead(bytes(body), resp.length)
                break
            body += chunk
            if len(body) > MAX_BODY:
                raise FetchError(TOO_LARGE, f"answer over {MAX_BODY >> 20} MiB")
        left()
        return body.decode("utf-8", errors="replace")
    except (socket.timeout, TimeoutError):
        raise FetchError(TIMEOUT, f"no complete answer within {timeout:g}s") from None
    except ConnectionRefusedError:
        raise FetchError(DOWN, REFUSED) from None
    except http.client.HTTPException as e:
        raise FetchError(HTTP_ERROR, f"bad HTTP answer: {type(e).__name__} {e}".strip()) from None
    except OSError as e:
        raise FetchError(DOWN, e.strerror or str(e)) from None
    finally:
        conn.close()


def capacity(metrics_url: str, where: tuple[str, str], timeout: float) -> float | None:
    """A number from a JSON document next to the metrics (TGI's /info max_batch_total_tokens), or None."""
    u = urllib.parse.urlsplit(metrics_url)
    try:
        doc = json.loads(fetch(urllib.parse.urlunsplit((u.scheme, u.netloc, where[0], "", "")), timeout))
        value = float(doc[where[1]])
    except (FetchError, ValueError, KeyError, TypeError):
        return None
    return value if value > 0 else None


# A generated-tokens rate whose counter's rounding (a kind's `digits`) could be off by more than this share of the
# tokens counted over its window is unknown: a number that may be 10 % wrong is not shown as the server's rate.
RATE_ERROR = 0.10


def resolution(value: float, digits: int | None) -> float:
    """The step of the last digit a number is printed with to `digits` significant digits (0: exact; counts below
    10**digits print whole)."""
    if digits is None or value < 10 ** digits:
        return 0.0
    return float(10 ** (math.floor(math.log10(value)) - digits + 1))


def tokens_rate(reads: collections.deque[tuple[float, float]], kind: kinds.Kind) -> tuple[float | None, float | None,
                                                                                              str]:
    """(tokens per second, the window in seconds it spans, why unknown) from a counter's reads, oldest first: from
    the newest read back to the newest one at least the kind's rate_window before it (or the oldest kept). Reads
    older than that are dropped."""
    if not reads:
        return None, None, ""
    now = reads[-1][0]
    while len(reads) > 2 and reads[1][0] <= now - kind.rate_window:
        reads.popleft()
    (t0, v0), (t1, v1) = reads[0], reads[-1]
    if t1 <= t0:
        return None, None, "one read since the counter started or reset: a rate needs two"
    counted = v1 - v0
    # Each printed value is within half a step of the true count.
    err = (resolution(v0, kind.digits) + resolution(v1, kind.digits)) / 2
    if err > RATE_ERROR * counted:
        return None, None, (f"the counter is printed to {kind.digits} significant digits: ±{err:g} tokens over "
                            f"{t1 - t0:.1f}s, more than {RATE_ERROR:.0%} of the {counted:g} counted")
    return counted / (t1 - t0), t1 - t0, ""


@dataclass
class Target:
    """One server as the scrape thread knows it; mutated only under Scraper.lock."""

    cfg: ServerConfig
    configured: bool
    kind: str  # configured kind, else found (command line, then exposition), else auto
    url: str
    # A discovered process whose command line names no kind is listed, not read: the agent does not send requests
    # to whatever else listens on a watched port (a proxy, a test server).
    read: bool = True
    pid: int | None = None
    pids: frozenset[int] = frozenset()
    good: Parsed | None = None
    good_at: float | None = None
    error: str = "not read yet"
    start_time: float | None = None
    kv_capacity: float | None = None  # TGI: its KV pool in tokens, from /info; llama-server: its slots, from /props
    counters: dict[str, tuple[float, float]] = field(default_factory=dict)  # counter field -> (value, read at)
    # The generated-tokens counter's reads (read at, value) back to the first at least the kind's rate_window old.
    generated: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    tokens_per_second: float | None = None  # generated tokens over tokens_window seconds of reads
    tokens_window: float | None = None
    tokens_why: str = ""  # why tokens_per_second is unknown while the counter is read
    scrapes: collections.Counter[str] = field(default_factory=collections.Counter)
    restarts: int = 0
    counter_resets: int = 0
    next_at: float = 0.0

    def restarted(self, why: str) -> None:
        # What was read from the old process says nothing about the new one.
        self.restarts += 1
        self.good, self.good_at = None, None
        self.start_time = self.kv_capacity = self.tokens_per_second = self.tokens_window = None
        self.counters = {}
        self.generated.clear()
        self.error = why
        log.info("server on port %d restarted (%s)", self.cfg.port, why)


class Scraper:
    def __init__(self, hostfs: HostFS, servers: list[ServerConfig] | None, ports: list[int],
                 clock: Callable[[], float] = time.monotonic, discover_every: float = DISCOVER_EVERY):
        self.fs = hostfs
        self.clock = clock
        self.discover = servers is None  # no list: servers are whatever listens on the watched ports
        self.ports = ports
        self.discover_every = discover_every
        self.lock = threading.Lock()
        self.targets: dict[int, Target] = {}
        for s in servers or []:
            self.targets[s.port] = self._target(s, True, s.kind)
        self.prealloc: frozenset[int] = frozenset()
        self.known_pids: frozenset[int] = frozenset()
        self.processes_known = False
        self.round_errors = 0
        self._next_discovery = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by watch() and stop(): the thread's wait ends before its time
        self.rounds = 0  # passes the thread made (tests count that it sleeps while nothing is due)
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def _target(cfg: ServerConfig, configured: bool, kind: str, host: str = "127.0.0.1") -> Target:
        url = str(cfg.metrics) if cfg.metrics is not None else kinds.metrics_url(cfg.port, kind, host)
        return Target(cfg, configured, kind, url)

    # ---- the thread ---------------------------------------------------------------------------------------
    def start(self) -> None:
        # The first walk of /proc before the first tick: until it, no GPU could be told pre-allocated or not.
        self._guarded(self.rediscover)
        self._next_discovery = self.clock() + self.discover_every
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="servers-read")
        self._thread = threading.Thread(target=self._run, name="servers", daemon=True)
        self._thread.start()

    def watch(self, ports: list[int]) -> None:
        """Discover on these ports from now on (a reload changed the watched ports): the next round walks /proc at
        once. A server found on a port no longer watched stays listed, as any found server does once its process
        has gone."""
        with self.lock:
            self.ports = list(ports)
        # After the ports: a round that has just taken the old time walks with the new ports (rediscover reads them
        # under the lock), one that has not walks now.
        self._next_discovery = self.clock()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - a bug here must not end the readings for good; counted, logged
            self.round_errors += 1
            log.exception("read round failed")

    def _run(self) -> None:
        while True:
            # The wake is cleared before the stop is looked at: a stop() from here on is seen now or ends the wait.
            # Looked at first, a stop() between the look and the clear had its wake wiped, and the thread slept on
            # for up to discover_every while stop() gave up its join and shut the pool down under it.
            self._wake.clear()  # before the round too: a watch() from here on is seen by it or ends the wait
            if self._stop.is_set():
                break
            self._guarded(self.round)
            self.rounds += 1
            self._wake.wait(self.idle_for())

    def idle_for(self) -> float:
        """Seconds until the next pass has anything to do: the next walk of /proc or the next server read due. A
        wakeup costs ~65 us of CPU here even with nothing due (2026-12-02): at a fixed 50 ms that was 0.13 % of a
        core for an idle agent. At least ROUND_S between passes, as before: a round that failed before its reads
        does not spin."""
        with self.lock:
            due = min((t.next_at for t in self.targets.values() if t.read), default=self._next_discovery)
        return min(max(ROUND_S, min(due, self._next_discovery) - self.clock()), self.discover_every)

    def round(self) -> None:
        """One pass: rediscover when due, then read every server whose interval has come round, in parallel."""
        now = self.clock()
        if now >= self._next_discovery:
            self._next_discovery = now + self.discover_every
            self.rediscover()
        with self.lock:
            due = [t for t in self.targets.values() if t.read and t.next_at <= now]
            for t in due:
                t.next_at = now + t.cfg.interval
        if not due:
            return
        pool = self._pool
        results = pool.map(self._read, due) if pool is not None else map(self._read, due)
        for t, (result, text, why, cap) in zip(due, results):
            self.record(t, result, text, why, cap)

    @staticmethod
    def _read(t: Target) -> tuple[str, str, str, float | None]:
        try:
            text = fetch(t.url, t.cfg.timeout)
        except FetchError as e:
            hint = kinds.kind(t.kind).http_hints.get(e.status or 0)
            return e.result, "", f"{e}: {hint}" if hint else str(e), None
        where = kinds.kind(t.kind).kv_capacity
        cap = capacity(t.url, where, t.cfg.timeout) if where is not None and t.kv_capacity is None else None
        return OK, text, "", cap

    # ---- what a read means ----------------------------------------------------------------------------------
    def record(self, t: Target, result: str, text: str, why: str, kv_capacity: float | None = None) -> None:
        parsed = None
        if kv_capacity is not None:
            t.kv_capacity = kv_capacity
        if result == OK:
            try:
                parsed = parse(text, t.kind, t.kv_capacity)
            except ExpositionError as e:
                result, why = GARBAGE, str(e)
        with self.lock:
            t.scrapes[result] += 1
            if parsed is None:
                t.error = why
                if why == REFUSED:
                    # Unlike a slow or garbled answer, this one says the server holds no requests any more: its
                    # last reading is dropped now, not when it is stale_after old.
                    t.good = None
                return
            if t.kind in ("auto", "generic") and parsed.kind != "generic":
                t.kind = parsed.kind
            if parsed.start_time is not None and t.start_time is not None and parsed.start_time != t.start_time:
                t.restarted("the server's process_start_time_seconds changed")
            now = self.clock()
            self._counters(t, parsed, now)
            t.start_time = parsed.start_time
            t.good, t.good_at, t.error = parsed, now, ""

    @staticmethod
    def _counters(t: Target, parsed: Parsed, now: float) -> None:
        """Counter resets, and the generated tokens' rate over the kind's window (None across a reset)."""
        for fld in kinds.COUNTERS:
            v = parsed.values.get(fld)
            prev = t.counters.pop(fld, None)
            if v is None:
                if fld == GENERATED:
                    t.generated.clear()
                continue
            t.counters[fld] = (v, now)
            if prev is not None and v < prev[0]:
                t.counter_resets += 1
                if fld == GENERATED:
                    t.generated.clear()
            if fld == GENERATED:
                t.generated.append((now, v))
        t.tokens_per_second, t.tokens_window, t.tokens_why = tokens_rate(t.generated, kinds.kind(t.kind))

    def rediscover(self) -> None:
        """Owners of the ports (pid changes are restarts), new servers on watched ports, pre-allocating pids."""
        procs = discovery.processes(self.fs)
        with self.lock:
            ports = set(self.targets) | (set(self.ports) if self.discover else set())
        listening = discovery.listening_inodes(self.fs, ports)
        owners = discovery.owners(self.fs, listening, procs) if procs else {}
        unseen = {port for port, _ in listening.values()} - set(owners)
        kids = discovery.children(procs)
        seen_pids: set[int] = set()
        with self.lock:
            self.processes_known = bool(procs)
            self.known_pids = frozenset(procs)
            self.prealloc = discovery.preallocating_pids(procs)
            for port in sorted(ports):
                pid, host = owners.get(port, (None, "127.0.0.1"))
                t = self.targets.get(port)
                if t is None and port in unseen and self.discover:
                    # Listening, but whose socket it is cannot be read: another user's /proc/<pid>/fd needs
                    # CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH, which a sandbox may refuse (the refusal is counted,
                    # qosagent_proc_unreadable_total{what="fd"}).
                    t = self.targets[port] = self._target(ServerConfig(port=port), False, "generic")
                    t.read, t.error = False, ("something listens here, but its process cannot be seen (another "
                                              "user's /proc/<pid>/fd): list it under servers: to read it")
                    continue
                if t is None:
                    # One server per process: Triton listens on 8000 and 8001, vLLM maybe on two ports.
                    if pid is None or pid in seen_pids:
                        continue
                    argv = list(procs[pid].argv)
                    kind = kinds.from_cmdline(argv) or "generic"
                    t = self.targets[port] = self._target(ServerConfig(port=port), False, kind)
                    log.info("listener found on port %d: pid %d, kind %s (%s)", port, pid, kind, " ".join(argv)[:120])
                if pid is not None:
                    seen_pids.add(pid)
                    if t.pid is not None and pid != t.pid:
                        t.restarted(f"pid {t.pid} -> {pid} on the same port")
                    found = kinds.from_cmdline(list(procs[pid].argv))
                    if t.kind == "auto":
                        t.kind = found or "auto"
                    elif not t.configured:
                        # What listens there now: the kind (and the metrics port, Triton's) follow the process.
                        t.kind, t.read = found or "generic", found is not None
                        if not found:
                            t.error = NOT_A_SERVER
                        elif t.error == NOT_A_SERVER:
                            t.error = "not read yet"
                        # A listener bound to one address answers there only (not on loopback).
                        t.url = kinds.metrics_url(port, t.kind, host)
                    t.pid = pid
                    t.pids = discovery.family(discovery.server_root(pid, procs), kids)
                elif procs and t.pid is not None:
                    t.error = f"nothing listens on port {port} (pid {t.pid} gone)"
                    t.pid, t.pids = None, frozenset()

    # ---- the Snapshot's part ---------------------------------------------------------------------------------
    def part(self) -> ServersPart:
        now = self.clock()
        out = []
        with self.lock:
            for port in sorted(self.targets):
                out.append(self._reading(self.targets[port], now))
            return ServersPart(tuple(out), self.prealloc, self.processes_known, self.known_pids, self.round_errors)

    def _reading(self, t: Target, now: float) -> ServerReading:
        age = now - t.good_at if t.good_at is not None else None
        known = t.good is not None and age is not None and age <= t.cfg.stale_after
        kind = t.kind if t.kind != "auto" else "generic"
        base = dict(port=t.cfg.port, kind=kind, url=t.url, configured=t.configured, pid=t.pid, pids=t.pids,
                    preallocates=kinds.kind(kind).preallocates, scrapes=MappingProxyType(dict(t.scrapes)),
                    restarts=t.restarts, counter_resets=t.counter_resets, age_s=age)
        if not t.read:
            return ServerReading(known=False, reason=t.error, **base)  # type: ignore[arg-type]
        if not known:
            why = t.error or "no reading"
            if t.good is not None:
                why = f"last good read {age:.1f}s ago (stale after {t.cfg.stale_after:g}s): {why}"
            return ServerReading(known=False, reason=why, **base)  # type: ignore[arg-type]
        assert t.good is not None
        v = t.good.values
        missing = dict(t.good.missing)
        if t.tokens_why:
            missing[GENERATED] = t.tokens_why
        return ServerReading(known=True, reason=t.error, kv_cache_usage=v.get(KV), requests_waiting=v.get(WAITING),
                             requests_running=v.get(RUNNING), preemptions=v.get(PREEMPTIONS),
                             generated_tokens_per_second=t.tokens_per_second,
                             generated_tokens_window_s=t.tokens_window,
                             missing=MappingProxyType(missing), **base)  # type: ignore[arg-type]
