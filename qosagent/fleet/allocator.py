"""`qosagent allocator`: one of 2-3 replicas; the elected one splits each tenant's fleet quota over the nodes
every report interval (alloc.allocate) and writes the grants to etcd, fenced by its election revision.

A replica that becomes leader waits one lease period before its first grants: until then nodes may still
enforce grants of the previous leader, which it cannot see; after it, those have lapsed or been reported as
held. Leases are measured by etcd's own TTLs and by each agent's monotonic clock, never by wall time, so a clock
jump on any machine extends nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from qosagent.config import Config
from qosagent.exposition import Family, families, one
from qosagent.fleet import records
from qosagent.fleet.alloc import Round, TenantRound, allocate
from qosagent.fleet.etcd import Etcd, EtcdError, Leadership
from qosagent.fleet.quotas import fleet_quotas
from qosagent.weblisten import Listener, Reply

log = logging.getLogger("qosagent.allocator")

# etcd refuses a transaction of more than 128 operations by default (--max-txn-ops): grants go in batches.
TXN_OPS = 120
# A tenant has converged after a shift when every node's reported held rate is within this fraction of the quota
# of its target; a shift is a round whose targets moved by more than SHIFT of the quota on some node.
SETTLED = 0.05
SHIFT = 0.10


@dataclass
class Stats:
    rounds: int = 0
    leader_changes: int = 0  # times this replica became leader
    deposed: int = 0  # fenced writes refused: another replica leads
    errors: dict[str, int] = field(default_factory=dict)  # etcd, malformed, foreign
    short: dict[str, int] = field(default_factory=dict)  # tenant -> rounds its quota was below nodes x minimum
    round_seconds: float = 0.0
    convergence: dict[str, float] = field(default_factory=dict)  # tenant -> seconds the last shift took to settle

    def count(self, kind: str, n: int = 1) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + n


class Allocator:
    def __init__(self, cfg: Config, etcd: Etcd, me: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.etcd = etcd
        self.me = me or f"{socket.gethostname()}-{os.getpid()}"
        self.clock = clock
        self.quotas = {t: q.rps for t, q in fleet_quotas(cfg).items()}
        self.lease_id = 0
        self.leading: Leadership | None = None
        self.leading_since = 0.0
        self.round_no = 0
        self.last: Round = Round()
        self.nodes = 0
        self.reachable = False
        self.stats = Stats()
        self._shift_at: dict[str, float] = {}
        self._targets: dict[str, dict[str, float]] = {}
        self._written: set[str] = set()  # nodes whose grant key this leader wrote (deleted when they go)
        self._stop = threading.Event()
        self._warned: set[str] = set()

    @property
    def is_leader(self) -> bool:
        return self.leading is not None

    @property
    def waiting(self) -> bool:
        return self.leading is not None and self.clock() - self.leading_since < self.cfg.fleet.lease

    def _ensure_lease(self) -> None:
        if self.lease_id and self.etcd.keepalive(self.lease_id) > 0:
            return
        if self.lease_id:
            log.warning("lease %x expired", self.lease_id)
            self._lose("its etcd lease expired")
        self.lease_id = self.etcd.grant(self.cfg.fleet.lease)

    def _lose(self, why: str) -> None:
        if self.leading is not None:
            log.warning("%s no longer leads: %s", self.me, why)
        self.leading = None
        self._written = set()

    def round(self) -> None:
        """One round: renew, campaign, and (leading, past the wait) allocate and write. Never raises for etcd."""
        t0 = time.process_time()
        self.stats.rounds += 1
        try:
            self._round()
            self.reachable = True
        except EtcdError as e:
            self.reachable = False
            self.stats.count("etcd")
            log.warning("etcd: %s", e)
        self.stats.round_seconds = time.process_time() - t0

    def _round(self) -> None:
        f = self.cfg.fleet
        self._ensure_lease()
        who = self.etcd.campaign(records.leader_key(f.prefix), self.me, self.lease_id)
        if not who.ours:
            self._lose(f"{who.leader or 'nobody'} leads")
            return
        if self.leading is None or self.leading.revision != who.revision:
            self.leading, self.leading_since = who, self.clock()
            self.stats.leader_changes += 1
            log.info("%s leads (election revision %d); first grants after one lease (%gs)", self.me, who.revision,
                     f.lease)
            self._written = {kv.key.rsplit("/", 1)[-1] for kv in self.etcd.get_prefix(records.grants_prefix(f.prefix))}
        reports = self._reports()
        self.nodes = len(reports)
        if self.waiting:
            return
        self.last = allocate(self.quotas, reports)
        self.round_no += 1
        self._track(reports)
        for tenant, t in self.last.tenants.items():
            if t.short:
                self.stats.short[tenant] = self.stats.short.get(tenant, 0) + 1
                self._warn(f"short:{tenant}", f"{tenant}: fleet_rps {self.quotas[tenant]:g} is below {len(reports)} "
                           "nodes x the per-node minimum: split evenly")
        self._write(self.last.by_node())

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", msg)

    def _reports(self) -> dict[str, dict[str, tuple[float, float]]]:
        prefix = records.nodes_prefix(self.cfg.fleet.prefix)
        out = {}
        for kv in self.etcd.get_prefix(prefix):
            node = kv.key[len(prefix):]
            try:
                if not node or "/" in node:
                    raise records.Malformed("not a node key")
                rep, foreign = records.decode_report(node, kv.value, self.quotas)
            except records.Malformed as e:
                self.stats.count("malformed")
                self._warn(f"bad:{kv.key}", f"{kv.key}: skipped ({e}); that node stays on its safe share")
                continue
            if foreign:
                self.stats.count("foreign", len(foreign))
                self._warn(f"foreign:{node}", f"{node} reports tenants without a fleet quota here: "
                           f"{', '.join(sorted(foreign))}")
            out[node] = dict(rep.tenants)
        return out

    def _write(self, grants: dict[str, dict[str, float]]) -> None:
        f = self.cfg.fleet
        assert self.leading is not None
        gp = records.grants_prefix(f.prefix)
        puts = [(gp + node, records.encode_grant(self.me, self.round_no, g), self.lease_id)
                for node, g in sorted(grants.items())]
        gone = [gp + node for node in sorted(self._written - grants.keys())]
        ops: list[tuple[list[tuple[str, bytes, int]], list[str]]] = []
        for i in range(0, max(len(puts), 1), TXN_OPS):
            ops.append((puts[i:i + TXN_OPS], []))
        for i in range(0, len(gone), TXN_OPS):
            ops.append(([], gone[i:i + TXN_OPS]))
        for p, d in ops:
            if (p or d) and not self.etcd.fenced(records.leader_key(f.prefix), self.leading.revision, p, d):
                self.stats.deposed += 1
                self._lose("another replica won the election (fenced write refused)")
                return
        self._written = set(grants)

    def _track(self, reports: dict[str, dict[str, tuple[float, float]]]) -> None:
        """Convergence after a shift, for the metric: zipped over the targets' values when the nodes are the same
        as last round (the usual case), and held looked at only while a shift is pending."""
        now = self.clock()
        for tenant, t in self.last.tenants.items():
            bound = SHIFT * self.quotas[tenant]
            before = self._targets.get(tenant, {})
            if before.keys() == t.target.keys():
                moved = any(abs(a - b) > bound for a, b in zip(t.target.values(), before.values()))
            else:
                moved = True
            if moved:
                self._shift_at.setdefault(tenant, now)
            self._targets[tenant] = t.target  # TenantRound's own dict, never changed after the round
            start = self._shift_at.get(tenant)
            if start is None:
                continue
            settled = SETTLED * self.quotas[tenant]
            if all(abs((reports[n][tenant][1] if tenant in reports[n] else 0.0) - v) <= settled
                   for n, v in t.target.items()):
                self.stats.convergence[tenant] = now - start
                del self._shift_at[tenant]

    def run(self) -> None:
        every = self.cfg.fleet.report_interval
        nxt = self.clock()
        while not self._stop.is_set():
            self.round()
            nxt += every
            delay = nxt - self.clock()
            if delay < 0:
                nxt, delay = self.clock(), 0.0
            self._stop.wait(delay)

    def stop(self) -> None:
        self._stop.set()

    def resign(self) -> None:
        """On a clean stop: revoke the lease, so the election key goes now and a standby takes over within a round
        (it still waits one lease before granting)."""
        if self.lease_id:
            try:
                self.etcd.revoke(self.lease_id)
            except EtcdError as e:
                log.warning("revoking lease on stop: %s (it expires by itself)", e)
        self.lease_id = 0
        self._lose("stopped")

    # ---- visibility --------------------------------------------------------------------------------------
    def ready(self) -> tuple[bool, str]:
        if not self.reachable:
            return False, "etcd not reachable in the last round"
        if self.leading is None:
            return True, "standby"
        return True, "leader (waiting one lease)" if self.waiting else "leader"

    def collect(self) -> Iterable[Metric]:
        return families(FAMILIES, self)


def _tenants(a: Allocator) -> list[tuple[str, float]]:
    return sorted(a.quotas.items())


def _rounds(a: Allocator) -> list[tuple[str, TenantRound]]:
    """The last round's tenants, on the leader only: a standby's last round is stale."""
    if not a.is_leader:
        return []
    return [(tenant, t) for tenant, _ in _tenants(a) if (t := a.last.tenants.get(tenant)) is not None]


FAMILIES: tuple[Family[Allocator], ...] = (
    Family("qosagent_allocator_leader", "gauge", "1 on the elected allocator, 0 on the others", (),
           one(lambda a: 1.0 if a.is_leader else 0.0)),
    Family("qosagent_allocator_etcd_up", "gauge", "1 when the last round reached etcd", (),
           one(lambda a: 1.0 if a.reachable else 0.0)),
    Family("qosagent_allocator_nodes", "gauge", "Nodes with a live report (leader only)", (),
           one(lambda a: float(a.nodes) if a.is_leader else 0.0)),
    Family("qosagent_allocator_rounds", "counter", "Rounds run", (), one(lambda a: a.stats.rounds)),
    Family("qosagent_allocator_leader_changes", "counter", "Times this replica became leader", (),
           one(lambda a: a.stats.leader_changes)),
    Family("qosagent_allocator_deposed", "counter", "Grant writes refused by the election fence", (),
           one(lambda a: a.stats.deposed)),
    Family("qosagent_allocator_round_cpu_seconds", "gauge", "CPU time of the last round", (),
           one(lambda a: a.stats.round_seconds)),
    Family("qosagent_allocator_errors", "counter", "Failed etcd rounds, malformed records and tenants without a "
           "fleet quota in reports", ("kind",),
           lambda a: (([kind], a.stats.errors.get(kind, 0)) for kind in ("etcd", "malformed", "foreign"))),
    Family("qosagent_allocator_quota_rps", "gauge", "Fleet quota (quota.fleet_rps)", ("tenant",),
           lambda a: (([tenant], q) for tenant, q in _tenants(a))),
    Family("qosagent_allocator_demand_rps", "gauge", "Demand reported, summed over nodes", ("tenant",),
           lambda a: (([tenant], t.demand) for tenant, t in _rounds(a))),
    Family("qosagent_allocator_granted_rps", "gauge", "Grants of the last round, summed over nodes", ("tenant",),
           lambda a: (([tenant], sum(t.grants.values())) for tenant, t in _rounds(a))),
    Family("qosagent_allocator_committed_rps", "gauge", "Sum over nodes of max(held, granted): never above the "
           "quota but for the documented slack", ("tenant",),
           lambda a: (([tenant], t.committed) for tenant, t in _rounds(a))),
    Family("qosagent_allocator_convergence_seconds", "gauge", "Time the last demand shift took until every node "
           "enforced its target", ("tenant",),
           lambda a: (([tenant], a.stats.convergence[tenant]) for tenant, _ in _tenants(a)
                      if tenant in a.stats.convergence)),
    Family("qosagent_allocator_short_rounds", "counter", "Rounds whose quota was below nodes x the per-node minimum "
           "(split evenly)", ("tenant",),
           lambda a: (([tenant], a.stats.short.get(tenant, 0)) for tenant, _ in _tenants(a))),
)


def allocator_server(alloc: Allocator, listen: str) -> Listener:
    """/metrics, /readyz (etcd reached in the last round, leader or standby) and /healthz (the loop runs), on the
    agent's own listener (weblisten)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(alloc)  # type: ignore[arg-type]

    def ready(_headers: Mapping[str, str]) -> Reply:
        ok, why = alloc.ready()
        return 200 if ok else 503, (why + "\n").encode(), "text/plain"

    return Listener(listen, {
        "/metrics": lambda _h: (200, generate_latest(registry), CONTENT_TYPE_LATEST),
        "/readyz": ready,
        "/healthz": lambda _h: (200, b"ok\n", "text/plain"),
    }, name="allocator-http")
