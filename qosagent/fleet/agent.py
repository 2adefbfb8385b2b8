"""The agent's side of fleet quotas, off the tick: a thread that every report interval (with jitter) renews the
node's etcd lease, reads this node's grant and writes the node's report.

The tick never waits on the network: it hands the thread its latest wants and reads the thread's latest state.
A grant counts as renewed when its record's mod revision moves (the allocator rewrites it every round); its
lease ends `lease` after the read that saw it move, on this host's monotonic clock (the kernel's clock too), so
a wall-clock jump here extends nothing, and an allocator that stops rewriting lets the lease run out.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from qosagent.fleet import records
from qosagent.fleet.alloc import Want
from qosagent.fleet.config import FleetConfig
from qosagent.fleet.etcd import Etcd, EtcdError

log = logging.getLogger("qosagent.fleet")


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


class Reporter:
    def __init__(self, cfg: FleetConfig, etcd: Etcd, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.etcd = etcd
        self.node = cfg.node_name
        self.clock = clock
        self.lease_id = 0
        self._lock = threading.Lock()
        self._wants: dict[str, Want] = {}
        self._seen = Seen()
        self._rev = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, wants: Mapping[str, Want]) -> None:
        with self._lock:
            self._wants = dict(wants)

    def seen(self) -> Seen:
        with self._lock:
            return self._seen

    def _run(self) -> None:
        while not self._stop.is_set():
            self.cycle()
            # Jitter (+-10 %) so that a fleet restarted at once does not report in lockstep.
            self._stop.wait(self.cfg.report_interval * random.uniform(0.9, 1.1))

    def cycle(self) -> None:
        """One report: lease, grant, report. A failure is counted and the last grant kept (its lease runs on)."""
        with self._lock:
            wants = dict(self._wants)
        s = self._seen
        try:
            if not self.lease_id or self.etcd.keepalive(self.lease_id) <= 0:
                self.lease_id = self.etcd.grant(self.cfg.lease)
            kv = self.etcd.get(records.grants_prefix(self.cfg.prefix) + self.node)
            grant, renewed, leader = s.grant, s.renewed_at, s.leader
            if kv is not None and kv.mod_revision != self._rev:
                g = records.decode_grant(kv.value)
                self._rev, grant, renewed, leader = kv.mod_revision, g.tenants, self.clock(), g.leader
            # The report after the grant: `held` then says what this node enforces from now on.
            self.etcd.put(records.nodes_prefix(self.cfg.prefix) + self.node,
                          records.encode_report(self.node, wants), self.lease_id)
            new = Seen(grant, renewed, leader, True, s.report_errors, s.last_error, s.reports + 1)
        except (EtcdError, records.Malformed, KeyError, ValueError) as e:
            if s.etcd_up or not s.report_errors:
                log.warning("fleet report failed (grant kept until its lease ends, then the safe share): %s", e)
            new = Seen(s.grant, s.renewed_at, s.leader, False, s.report_errors + 1, str(e), s.reports)
        with self._lock:
            self._seen = new

    def stop(self) -> None:
        """Stop reporting and revoke the node's lease: its report goes now and the allocator frees its share at
        the next round (what the kernel holds ends with the heartbeat)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.cfg.report_interval * 1.2 + 2 * (self.etcd.client.timeout.read or 1))
        if self.lease_id:
            try:
                self.etcd.revoke(self.lease_id)
            except EtcdError as e:
                log.info("revoking the node's lease: %s (it expires by itself)", e)
            self.lease_id = 0
        self.etcd.close()
