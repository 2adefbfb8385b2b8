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

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from qosagent.config import Config
from qosagent.exposition import Family, families, one
from qosagent.fleet import records
from qosagent.fleet.alloc import Column, Ledger, Round, Row, TenantRound
from qosagent.fleet.etcd import Etcd, EtcdError, Leadership
from qosagent.fleet.quotas import fleet_quotas
from qosagent.weblisten import Listener, Reply, Route, Security

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
        self.ledger = Ledger(self.quotas, cfg.fleet.capacity_rps,
                             {t.name: cfg.tiers[t.tier].weight for t in cfg.tenants if t.name in self.quotas})
        self.decoder = records.Reports(self.quotas)
        self.lease_id = 0
        self.leading: Leadership | None = None
        self.leading_since = 0.0
        self.round_no = 0
        self.last: Round = Round()
        self.nodes = 0
        self.reachable = False
        self.stats = Stats()
        self._shift_at: dict[str, float] = {}
        self._targets: dict[str, Column] = {}
        # Nodes whose grant key holds a grant of this leader: the tenants' rates written (packed, in the ledger's
        # order).
        self._written: dict[str, bytes] = {}
        # Each node's report as of the mod revision it was read at (and whether it decoded; a malformed one is not
        # read again until rewritten), and the store's revision of the last read: a round decodes only the reports
        # written since.
        self._seen: dict[str, tuple[int, bool]] = {}
        self._read_rev = 0
        self._unallocated: dict[str, Row] = {}  # read while waiting one lease
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
        self._written = {}

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
            # Grant keys left by another leader (gone with its lease by now, unless it was this replica's): no
            # rates never equal a round's, so each is rewritten, or deleted if its node went.
            self._written = {kv.key.rsplit("/", 1)[-1]: b""
                             for kv in self.etcd.get_prefix(records.grants_prefix(f.prefix))}
        nodes, changed = self._reports()
        self.nodes = len(nodes)
        self._unallocated.update(changed)
        if self.waiting:
            return
        self.last, moved, dirty = self.ledger.round(nodes, self._unallocated)
        self._unallocated = {}
        self.round_no += 1
        self._track(dirty)
        for tenant in self.last.tenants:
            if self.last.tenants[tenant].short:
                self.stats.short[tenant] = self.stats.short.get(tenant, 0) + 1
                self._warn(f"short:{tenant}", f"{tenant}: its pool ({self.last.tenants[tenant].pool:g} rps) is "
                           f"below {len(nodes)} nodes x the per-node minimum: split evenly")
        if self.last.capacity_short:
            self._warn("capacity", f"fleet.capacity_rps {f.capacity_rps:g} is below the tenants' floors (each "
                       "tenant's per-node minimum on every node): each gets its floor's part")
        self._write(moved | (self._written.keys() - set(nodes)) | (set(nodes) - self._written.keys()))

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", msg)

    def _reports(self) -> tuple[list[str], dict[str, Row]]:
        """Every node with a valid report (in key order), and the reports written since the last read: the keys
        and their revisions first, then the values of the changed ones alone, at the same revision."""
        prefix = records.nodes_prefix(self.cfg.fleet.prefix)
        keys, rev = self.etcd.range_prefix(prefix, keys_only=True)
        live = {kv.key[len(prefix):]: kv.mod_revision for kv in keys}
        self._seen = {n: v for n, v in self._seen.items() if n in live}
        changed: dict[str, Row] = {}
        if any(n not in self._seen or self._seen[n][0] != r for n, r in live.items()):
            kvs, _ = self.etcd.range_prefix(prefix, min_mod_revision=self._read_rev + 1 if self._seen else 0,
                                            revision=rev)
            for kv in kvs:
                node = kv.key[len(prefix):]
                if self._seen.get(node, (None,))[0] == kv.mod_revision:
                    continue
                self._seen[node] = kv.mod_revision, False
                try:
                    if not node or "/" in node:
                        raise records.Malformed("not a node key")
                    rep, foreign = self.decoder.decode(node, kv.value)
                except records.Malformed as e:
                    self.stats.count("malformed")
                    self._warn(f"bad:{kv.key}", f"{kv.key}: skipped ({e}); that node stays on its safe share")
                    continue
                if foreign:
                    self.stats.count("foreign", len(foreign))
                    self._warn(f"foreign:{node}", f"{node} reports tenants without a fleet quota here: "
                               f"{', '.join(sorted(foreign))}")
                changed[node] = rep.demand, rep.held
                self._seen[node] = kv.mod_revision, True
        self._read_rev = rev
        return [n for n, (_, valid) in self._seen.items() if valid], changed

    def _write(self, nodes: set[str]) -> None:
        """The grants of `nodes` that changed (written) or whose node went (deleted), then the round record that
        renews every grant, in fenced transactions of at most TXN_OPS operations, the round record last: a round
        whose writes were refused part way renews nothing (what did land was staged within the quota)."""
        f = self.cfg.fleet
        assert self.leading is not None
        gp = records.grants_prefix(f.prefix)
        puts: list[tuple[str, bytes, int]] = []
        gone: list[str] = []
        head = records.grant_head(self.me, self.round_no) + records.names_block(self.ledger.names)
        rates: dict[str, bytes] = {}
        for node in sorted(nodes):
            i = self.ledger.index.get(node)
            if i is None:
                gone.append(node)
                continue
            g = rates[node] = self.ledger.grants[i].astype("<f8").tobytes()
            if g != self._written.get(node):
                puts.append((gp + node, head + g, self.lease_id))
        ops: list[tuple[list[tuple[str, bytes, int]], list[str]]] = [
            (puts[i:i + TXN_OPS], []) for i in range(0, len(puts), TXN_OPS)]
        ops += [([], [gp + n for n in gone[i:i + TXN_OPS]]) for i in range(0, len(gone), TXN_OPS)]
        ops.append(([(records.round_key(f.prefix), records.encode_round(self.me, self.round_no), self.lease_id)],
                    []))
        for p, d in ops:
            if not self.etcd.fenced(records.leader_key(f.prefix), self.leading.revision, p, d):
                self.stats.deposed += 1
                self._lose("another replica won the election (fenced write refused)")
                return
            for key, _value, _lease in p:
                node = key[len(gp):]
                if node in rates:
                    self._written[node] = rates[node]
            for key in d:
                self._written.pop(key[len(gp):], None)

    def _track(self, dirty: set[str]) -> None:
        """Convergence after a shift, for the metric: only the tenants re-split this round can have moved or
        settled (a report that moved held re-splits its tenants)."""
        now = self.clock()
        for tenant in dirty:
            target = self.last.tenants[tenant].target
            assert isinstance(target, Column)
            before = self._targets.get(tenant)
            # The same nodes (the ledger replaces its index when they change, never edits it) and each target
            # within SHIFT of the quota of what it was: no shift.
            if before is None or before.index is not target.index or (
                    len(target) and np.abs(target.array - before.array).max() > SHIFT * self.quotas[tenant]):
                self._shift_at.setdefault(tenant, now)
            self._targets[tenant] = target  # the round's own copy, never changed after it
            start = self._shift_at.get(tenant)
            if start is None:
                continue
            held = self.ledger.held[:, self.ledger.names.index(tenant)]
            if not len(target) or np.abs(held - target.array).max() <= SETTLED * self.quotas[tenant]:
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


def allocator_servers(alloc: Allocator, listen: str, sec: Security | None = None,
                      health_listen: str | None = None) -> list[Listener]:
    """/metrics, /readyz (etcd reached in the last round, leader or standby) and /healthz (the loop runs) on the
    agent's own listener (weblisten), /metrics under sec's TLS and basic auth as the agent's; and, with
    health_listen, the two health routes alone in plain HTTP for probes. Raises OSError as Listener does."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(alloc)  # type: ignore[arg-type]

    def ready(_headers: Mapping[str, str]) -> Reply:
        ok, why = alloc.ready()
        return 200 if ok else 503, (why + "\n").encode(), "text/plain"

    health: dict[str, Route] = {"/readyz": ready, "/healthz": lambda _h: (200, b"ok\n", "text/plain")}
    out = [Listener(listen, {"/metrics": lambda _h: (200, generate_latest(registry), CONTENT_TYPE_LATEST),
                             **health}, sec or Security(), frozenset({"/metrics"}), name="allocator-http")]
    if health_listen:
        try:
            out.append(Listener(health_listen, health, name="allocator-health"))
        except OSError:
            out[0].close()  # never started
            raise
    return out
