"""The tick's read of the kernel's rows (bpfmaps.Changes: the slots whose generation moved) as the part's numbers:
since-start histograms as read, window histograms as the difference to the window's start, counters per tenant.

What the tick makes of each tenant is kept between ticks and rebuilt only where it can have changed: the tenants
read this tick, those whose window start passed one of their checkpoints (qosagent/window.py), those with requests in
their window (their rate is over the window's length, which moves every tick), and every one after a reload or a
change of admission.signal. An idle tenant costs nothing per tick: the tenants and windows the parts hold are
RowMaps, whose next version shares the rows of its base and copies only those changed since it (one full copy once
more than an eighth of the rows changed since it)."""

from __future__ import annotations

from typing import Mapping, NamedTuple

from qosagent.hist import Histogram, Since
from qosagent.latency import bpfmaps as bm
from qosagent.latency.model import TenantLatency
from qosagent.rowmap import RowMap
from qosagent.tenants import UNMATCHED_ID, TenantInfo
from qosagent.window import Windows


class RunQueue(NamedTuple):
    """Run-queue waits of the serving processes' threads, since start and over the window: every one's, and by row
    (the name of the row's tier, or model.SHARED_TIER for processes serving several tiers)."""

    total: Histogram
    window: Histogram
    tiers: dict[str, Histogram]
    tiers_window: dict[str, Histogram]


class Tenants:
    def __init__(self, window_s: float):
        self._windows: Windows[int, bm.Cumulative] = Windows(window_s, bm.ZERO)
        self._runq: Windows[int, Histogram] = Windows(window_s, Histogram())  # by run-queue row
        self._runq_view: RunQueue | None = None  # what runqueue() made of them, until they or the names change
        self._runq_names: Mapping[int, str] = {}
        self._built: dict[int, TenantLatency] = {}
        self._windowed: set[int] = set()
        self._everything = True
        self._signal = ""
        self._current: Mapping[int, TenantInfo] = {}
        self._known: Mapping[int, TenantInfo] = {}
        # By name, in tenant id order; each part holds the version of its tick (a RowMap: shared, never copied).
        self.tenants: RowMap[str, TenantLatency] = RowMap()
        self.windows: RowMap[str, tuple[str, Histogram]] = RowMap()  # name -> (tier, its window of the signal)
        self.busy: set[str] = set()  # the tenants whose window of the signal holds requests
        self.counted = 0  # connections tracked and requests started, every tenant's (hooks.counted)
        self.egress_unread = 0  # sockops mode: packets the egress learner could not hand to lat_egress (Hooks)
        self.version = 0  # moves whenever tenants, windows, busy or the run queue's windows may have: a part anew
        # The last update changed a configured tenant's row or window: what decisions read (the unmatched tenant's,
        # requests on a watched port that no tenant claims such as the agent's own reads of a server's metrics, and
        # the run queue's are reported only).
        self.rows_moved = True

    def configure(self, current: Mapping[int, TenantInfo], known: Mapping[int, TenantInfo], window_s: float) -> None:
        """The config's tenants (current), and the names of any a reload removed (known); a new window length starts
        the windows again."""
        if window_s != self._windows.span:
            self._windows.restart(window_s)
            self._runq.restart(window_s)
            self._runq_view = None
        self._current, self._known, self._everything = current, known, True

    def update(self, now: float, changes: bm.Changes, signal: str) -> None:
        w = self._windows
        for tid, new in changes.tenants.items():
            self.counted += _counted(new) - _counted(w.current(tid))
            self.egress_unread += new.counter(bm.C_EGRESS_UNREAD) - w.current(tid).counter(bm.C_EGRESS_UNREAD)
        moved = w.tick(now, changes.tenants)
        runq_moved = self._runq.tick(now, changes.runq or {})
        if runq_moved or changes.runq:
            self._runq_view = None
        elapsed = now - w.start
        everything = self._everything or signal != self._signal
        if everything or changes.tenants or moved or self._windowed or changes.runq or runq_moved:
            self.version += 1
        if everything:
            # Configured tenants, and any a reload removed that still have counts since start.
            rebuild = sorted(set(self._current) | set(w.keys()))
            self._built = {}
        else:
            rebuild = list(set(changes.tenants) | moved | self._windowed)
        current = self._current
        self.rows_moved = everything or any(tid in current and tid != UNMATCHED_ID for tid in rebuild)
        for tid in rebuild:
            info = self._current.get(tid) or self._known.get(tid) or TenantInfo(tid, f"id-{tid}", "none", 0, 0.0)
            t = self._built[tid] = tenant(info, w.current(tid), w.base(tid), elapsed)
            if t.response_window.count:
                self._windowed.add(tid)
            else:
                self._windowed.discard(tid)
        whole = everything or len(self.tenants) != len(self._built)
        tenants: dict[str, TenantLatency] = {}
        windows: dict[str, tuple[str, Histogram]] = {}
        if whole:
            tenants = {t.tenant: t for _tid, t in sorted(self._built.items())}
            self.busy = set()
            rebuild = list(self._built)
        for tid in rebuild:
            t = self._built[tid]
            tenants[t.tenant] = t
            window = windows[t.tenant] = (t.tier, t.window(signal))
            if window[1].count:
                self.busy.add(t.tenant)
            else:
                self.busy.discard(t.tenant)
        if whole:
            self.tenants, self.windows = RowMap(tenants), RowMap(windows)
        else:  # the next versions: the rows rebuilt since their base are copied, the others shared (RowMap.replace)
            self.tenants, self.windows = self.tenants.replace(tenants), self.windows.replace(windows)
        self._everything, self._signal = False, signal

    def runqueue(self, names: Mapping[int, str]) -> RunQueue:
        """The run-queue histograms (names: row -> its name), made again only when a row or its window moved: the
        rows partition the serving processes, so every process's waits are the rows' sum."""
        if self._runq_view is not None and names is self._runq_names:
            return self._runq_view
        r = self._runq
        rows = sorted(r.keys())
        total = sum((r.current(i) for i in rows), Histogram())
        base = sum((r.base(i) for i in rows), Histogram())
        tiers = {names.get(i, f"row-{i}"): (r.current(i), Since(r.current(i), r.base(i))) for i in rows}
        self._runq_names = names
        self._runq_view = RunQueue(total, Since(total, base), {n: h for n, (h, _) in tiers.items()},
                                   {n: w for n, (_, w) in tiers.items()})
        return self._runq_view


def _counted(c: bm.Cumulative) -> int:
    return c.counter(bm.C_CONNS) + c.counter(bm.C_STARTED)


def tenant(info: TenantInfo, now: bm.Cumulative, base: bm.Cumulative, elapsed: float) -> TenantLatency:
    """One tenant's numbers: since start (now) and over the window (since base, elapsed seconds ago)."""
    c = now.counter

    def since(kind: int) -> tuple[Histogram, Histogram]:
        h = now.hist[kind]
        return h, Since(h, base.hist[kind])

    headers, headers_window = since(bm.KIND_HEADERS)
    ttft, ttft_window = since(bm.KIND_TTFT)
    resp, resp_window = since(bm.KIND_RESPONSE)
    itl, itl_window = since(bm.KIND_ITL)
    return TenantLatency(
        tenant=info.name,
        tier=info.tier,
        requests=resp.count,
        headers=headers,
        ttft=ttft,
        response=resp,
        inter_token=itl,
        headers_window=headers_window,
        ttft_window=ttft_window,
        response_window=resp_window,
        inter_token_window=itl_window,
        rate_rps=resp_window.count / elapsed if elapsed > 0 else 0.0,
        in_flight=max(c(bm.C_STARTED) - resp.count - c(bm.C_UNPAIRED_CLOSE), 0),
        unpaired=c(bm.C_UNPAIRED_SEND) + c(bm.C_UNPAIRED_CLOSE),
        overlapped=c(bm.C_OVERLAPPED),
        unpaired_send=c(bm.C_UNPAIRED_SEND),
        unpaired_close=c(bm.C_UNPAIRED_CLOSE),
        pipelined=c(bm.C_PIPELINED),
        connections=c(bm.C_CONNS),
        multiplexed_connections=c(bm.C_MUX_CONNS),
        lost=c(bm.C_LOST),
        untracked=c(bm.C_UNTRACKED),
        no_ttft={reason: n for reason, what in bm.NO_TTFT_REASONS.items() if (n := c(what))},
        interim=c(bm.C_INTERIM),
        framed=c(bm.C_FRAMED),
        adopted=c(bm.C_ADOPTED),
    )
