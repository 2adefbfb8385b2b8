"""The agent's side of fleet quotas, off the tick: a thread that every report interval (with jitter) renews the
node's etcd lease, reads this node's grant and writes the node's report; and one that watches the round record,
so that the grant is read as soon as a round has written it (polled POLLS_PER_REPORT times an interval instead
while that watch is down).

The tick never waits on the network: it hands the thread its latest wants and reads the thread's latest state.
The node's grant and the leader's round record are read together (one transaction, one revision); the grant
counts as renewed when the round record's mod revision moves under the leader that wrote the grant (the leader
rewrites the round record every round, a grant only when it changes). Its lease ends `lease` after the read that
saw the move, on this host's monotonic clock (the kernel's clock too), so a wall-clock jump here extends
nothing, and an allocator that stops its rounds lets the lease run out.

The report written right after that read says, as `held`, the grant just read (what the tick enforces from
its next run on), not what the last tick enforced: a moved share reaches the allocator in this report, not the
next one. A share moving between nodes waits on two reports (the giver's lower rate, then the taker's higher
one), so this halves a move. A higher grant reported before the tick writes it claims more than the kernel
holds (harmless: the allocator counts the grant anyway); a lower one claims less for up to one agent interval
(the slack that adds: docs/fleet.md). A report identical to the last one written is not written again:
the node's etcd lease keeps it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from qosagent.fleet import records
from qosagent.fleet.config import FleetConfig
from qosagent.fleet.etcd import Etcd, EtcdError

log = logging.getLogger("qosagent.fleet")

# The wants are looked at this many times a report interval (a demand move is reported early); while the watch
# on the round record is down, the grant is polled as often (one small read of two keys), so that a lowered grant
# is reported, and a raised one enforced, within a fraction of an interval of the round that wrote it.
POLLS_PER_REPORT = 4
EARLY_MOVE = 0.25  # a move of demand (relative) that a poll reports before the interval is up
# The capability's demand is request starts over the last second (quota's admitted + dropped rates): for that
# long after a raise of a node its rate held back, demand measured under the lower rate understates what the
# node would take (clients that were refused back off), so the raised rate stands in for it until the measure
# has caught up.
DEMAND_WINDOW = 1.0
LIMITED = 0.95  # demand at this fraction of the rate enforced or above: the rate held the node back


@dataclass(frozen=True)
class Seen:
    """What the reporter knows now; renewed_at is on the monotonic clock, None before the first grant."""

    grant: Mapping[str, float] = field(default_factory=dict)
    renewed_at: float | None = None
    leader: str = ""
    etcd_up: bool = False
    report_errors: int = 0
    last_error: str = ""
    reports: int = 0
    watching: bool = False  # the watch on the round record is up (else the grant is polled)
    watch_breaks: int = 0


class Reporter:
    def __init__(self, cfg: FleetConfig, etcd: Etcd, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.etcd = etcd
        self.node = cfg.node_name
        self.clock = clock
        self.lease_id = 0
        self._lock = threading.Lock()
        self._wants: dict[str, records.Want] = {}
        self._seen = Seen()
        self._rev = 0  # mod revision of the round record at the last renewal
        self._sent = b""  # the last report written under self.lease_id
        self._stop = threading.Event()
        self._reported: dict[str, float] = {}  # demand per tenant in the last report written
        self._raised: dict[str, tuple[float, float]] = {}  # tenant -> (until, rate): a raise not yet measured
        self._wake = threading.Event()  # the round record moved (the watch), or stop
        self._watching = False
        self._watch_breaks = 0
        self._thread = threading.Thread(target=self._run, name="fleet-reporter", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="fleet-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._watcher.start()

    def offer(self, wants: Mapping[str, records.Want]) -> None:
        with self._lock:
            self._wants = dict(wants)

    def seen(self) -> Seen:
        with self._lock:
            return self._seen

    def _run(self) -> None:
        every = self.cfg.report_interval
        due = 0.0
        while not self._stop.is_set():
            full = self.clock() >= due
            woke = self._wake.is_set()
            self._wake.clear()  # a move after this is read by this cycle or wakes the next
            self.cycle(full, read=full or woke or not self._watching)
            if full:
                # Jitter (+-10 %) so that a fleet restarted at once does not report in lockstep.
                due = self.clock() + every * random.uniform(0.9, 1.1)
            self._wake.wait(min(every / POLLS_PER_REPORT, max(due - self.clock(), 0.0)))

    def _watch(self) -> None:
        """Wake the reporter at every move of the round record. The leader moves it every report interval, so a
        watch silent for a lease is taken as broken (etcd or the connection gone, or no leader) and set up
        again after an interval; meanwhile the reporter polls."""
        key = records.round_key(self.cfg.prefix)
        while not self._stop.is_set():
            try:
                for _rev in self.etcd.watch(key, idle=self.cfg.lease):
                    self._watching = True
                    self._wake.set()
            except EtcdError as e:
                if not self._stop.is_set():
                    self._watch_breaks += 1
                    if self._watch_breaks == 1 or self._watching:
                        log.info("watch on the round record down, polling the grant (%s)", e)
            self._watching = False
            self._stop.wait(self.cfg.report_interval)

    def _moved(self, wants: Mapping[str, records.Want]) -> bool:
        """A tenant's demand moved by more than EARLY_MOVE (and at least 1 rps) since the last report."""
        for t, w in wants.items():
            old = self._reported.get(t, 0.0)
            if abs(w.demand - old) >= max(EARLY_MOVE * max(w.demand, old), 1.0):
                return True
        return False

    def cycle(self, full: bool = True, read: bool = True) -> None:
        """With read, a read of the grant; with full (once a report interval), the lease renewed and the report
        written even if nothing moved; else a report only if the grant or demand moved. A failure is counted and
        the last grant kept (its lease runs on)."""
        with self._lock:
            wants = dict(self._wants)
        s = self._seen
        # A renewal read stands even if the report after it fails.
        grant, renewed, leader = s.grant, s.renewed_at, s.leader
        try:
            if not self.lease_id or (full and self.etcd.keepalive(self.lease_id) <= 0):
                self.lease_id, self._sent = self.etcd.grant(self.cfg.lease), b""
            kv, rnd = self.etcd.get_many([records.grants_prefix(self.cfg.prefix) + self.node,
                                          records.round_key(self.cfg.prefix)]) if read else (None, None)
            fresh = False
            if kv is not None and rnd is not None and rnd.mod_revision != self._rev:
                g = records.decode_grant(kv.value)
                if records.decode_round(rnd.value)[0] == g.leader:
                    self._rev, renewed, leader = rnd.mod_revision, self.clock(), g.leader
                    fresh = g.tenants != grant
                    until = renewed + DEMAND_WINDOW + self.cfg.report_interval
                    for t, rate in g.tenants.items():
                        w = wants.get(t)
                        # Only a node its old rate held back (its demand, refused starts included, reached it):
                        # one that had room measured its real demand, and standing in for it would ratchet.
                        if w is not None and rate > w.held and w.demand >= LIMITED * w.held:
                            self._raised[t] = until, rate
                    grant = g.tenants
            now = self.clock()
            self._raised = {t: v for t, v in self._raised.items() if v[0] > now}
            if renewed is not None and now - renewed < self.cfg.report_interval:
                # What the tick enforces from its next run on (the lease has at least an interval to run).
                wants = {t: records.Want(w.demand, grant[t]) if t in grant else w for t, w in wants.items()}
            if self._raised:
                wants = {t: records.Want(max(w.demand, self._raised[t][1]), w.held) if t in self._raised else w
                         for t, w in wants.items()}
            report = records.encode_report(self.node, wants)
            wrote = 0
            if report != self._sent and (full or fresh or self._moved(wants)):
                try:
                    self.etcd.put(records.nodes_prefix(self.cfg.prefix) + self.node, report, self.lease_id)
                except EtcdError:
                    # Most likely the lease expired between renewals (a partition healed): take a new one next.
                    self.lease_id = 0
                    raise
                self._sent, wrote = report, 1
                self._reported = {t: w.demand for t, w in wants.items()}
            new = Seen(grant, renewed, leader, True, s.report_errors, s.last_error, s.reports + wrote, self._watching,
                       self._watch_breaks)
        except (EtcdError, records.Malformed, KeyError, ValueError) as e:
            if s.etcd_up or not s.report_errors:
                log.warning("fleet report failed (grant kept until its lease ends, then the safe share): %s", e)
            new = Seen(grant, renewed, leader, False, s.report_errors + 1, str(e), s.reports, self._watching,
                       self._watch_breaks)
        with self._lock:
            self._seen = new

    def stop(self) -> None:
        """Stop reporting and revoke the node's lease: its report goes now and the allocator frees its share at
        the next round (what the kernel holds ends with the heartbeat)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.cfg.report_interval * 1.2 + 2 * (self.etcd.client.timeout.read or 1))
        if self.lease_id:
            try:
                self.etcd.revoke(self.lease_id)
            except EtcdError as e:
                log.info("revoking the node's lease: %s (it expires by itself)", e)
            self.lease_id = 0
        self.etcd.close()
