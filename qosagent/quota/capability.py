"""Per-tenant quotas in the kernel: the quota capability's face (probe, start, collect, prepare, stop, detach),
wiring its datapath, where it sits (interfaces.py), the limits writer offered to admission (limits.py), the tick's
read as the part (reading.py) and what it shows (export.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Container, Iterable, Mapping

from qosagent.capability import (UNCHANGED, AgentContext, Attention, Capability, CapabilityError, Change, Verdict,
                                 rewrite)
from qosagent.config import Config
from qosagent.ebpf import mapsize
from qosagent import netns
from qosagent.pods.service import Pods
from qosagent.quota import datapath as dp
from qosagent.quota import export, planning, reading, tc
from qosagent.quota.interfaces import NamespaceEgress, interfaces
from qosagent.quota.limits import FleetWriter, LimitsWriter, override_buckets
from qosagent.quota.model import QUOTA, QuotaPart
from qosagent.quota.rules import baseline_buckets
from qosagent.retention import EVERYONE
from qosagent.schedule import Every
from qosagent import sandbox
from qosagent.sandbox import Need
from qosagent.snapshot import Snapshot
from qosagent.tenants import (
    FLEET_SERVICE,
    LIMITS_SERVICE,
    UNMATCHED_ID,
    TenantInfo,
    TenantLimit,
    baseline,
    tenant_table,
)

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.features import Features

log = logging.getLogger("qosagent.quota")

# The heartbeat is written this many times per quota.heartbeat_timeout (once a second at the default 5 s), not every
# tick: what the timeout promises is how soon after the agent's last heartbeat the kernel falls back to the
# baseline, and a live agent's ticks would have to stall for 4/5 of it before its overrides lapsed.
BEATS_PER_TIMEOUT = 5


def heartbeat_every(timeout: float) -> float:
    return timeout / BEATS_PER_TIMEOUT


@dataclass(frozen=True)
class _Written:
    """What a config makes of the datapath: kept for the old config too, so a reload can be undone."""

    config: Config
    interfaces: list[str]
    derived: tuple[dict[str, Any], dict[int, TenantInfo]]
    overrides: dict[str, TenantLimit]


class Quota(Capability):
    name = "quota"
    uses = (netns.Follower, Pods)
    offers = (LIMITS_SERVICE, FLEET_SERVICE)
    loads_bpf = True

    @classmethod
    def sandbox_needs(cls, config: Config) -> list[Need]:
        bpffs = sandbox.bpffs_of(config.bpf.pin_root)
        return [
            Need("CapabilityBoundingSet", "CAP_BPF", "create maps, load programs"),
            Need("CapabilityBoundingSet", "CAP_NET_ADMIN", "the clsact qdisc and its cls_bpf filter"),
            Need("RequiresMountsFor", bpffs, "bpffs: the pins that outlive a restart (the handover)"),
            Need("ReadWritePaths", bpffs, f"the pins under bpf.pin_root ({config.bpf.pin_root})"),
            *(sandbox.other_processes("find the pods' network namespaces (/proc/PID/ns/net)", fds=False)
              if config.quota.namespaces else []),
        ]

    def __init__(self, ctx: AgentContext):
        super().__init__(ctx)
        self.datapath: dp.Datapath | None = None
        self.overrides: dict[str, TenantLimit] = {}
        self.fleet: dict[str, tuple[TenantLimit, int]] = {}  # tenant -> fleet share, end of its lease (ktime ns)
        self.attached: list[str] = []
        self.others: list[str] = []
        self.namespaces = NamespaceEgress(ctx)
        self.beat = Every(heartbeat_every(ctx.config.quota.heartbeat_timeout))
        self.view = reading.Tenants()  # what the tick makes of each tenant, kept between ticks
        # What each tick needs from the config, worked out once per start or reload rather than every 100 ms.
        self.specs: dict[str, Any] = {}
        self.table: dict[int, TenantInfo] = {}

    @staticmethod
    def _derive(cfg: Config) -> tuple[dict[str, Any], dict[int, TenantInfo]]:
        try:
            table = tenant_table(cfg)
        except ValueError as e:
            raise CapabilityError(str(e)) from None
        return baseline(cfg), {tid: info for tid, info in table.items() if tid != UNMATCHED_ID}

    def probe(self, features: "Features") -> Verdict:
        return planning.verdict(self.ctx.config, self.ctx.hostfs, features)

    def start(self, plan: tuple[str, ...]) -> None:
        """plan: the other filters and programs probe found on the hooks, which status names."""
        cfg = self.ctx.config
        self.others = list(plan)
        self.specs, self.table = self._derive(cfg)
        try:
            self.datapath = dp.Datapath(cfg, self.ctx.hostfs)
            self.datapath.write_config(cfg, baseline_buckets(cfg))
            self.attached = interfaces(cfg, self.ctx.hostfs)
            for line in self.datapath.attach(self.attached):
                log.info("%s", line)
            self._follow(starting=True)
        except Exception as e:  # noqa: BLE001 - bcc, netlink and bpf() all raise their own kinds
            self._failed_start()
            raise CapabilityError(f"cannot load or attach the classifier: {e}") from e
        if self.datapath.adopted:
            log.info("adopted pinned quota state at %s", self.datapath.path)
        self.ctx.services[LIMITS_SERVICE] = LimitsWriter(self)
        self.ctx.services[FLEET_SERVICE] = FleetWriter(self)

    def maintain(self) -> None:
        assert self.datapath is not None
        now = self.ctx.clock()
        # Adaptive limits hold in the kernel only while the last heartbeat is younger than quota.heartbeat_timeout.
        if self.beat.due(now):
            self.datapath.heartbeat()
        # Serving network namespaces come and go (pods): followed on their own schedule, not by a restart.
        if self.namespaces.every.due(now):
            self._follow()

    def collect(self) -> QuotaPart:
        d = self.datapath
        assert d is not None
        r = d.read_changed()
        self.view.update(r, self.table, self.specs, self.overrides, self.fleet, self.ctx.config.quota.heartbeat_timeout)
        return reading.part(r, self.view, tuple(self.attached), d.path, tuple(self.others), self.namespaces.shown)

    def quiet(self) -> bool:
        # What no tenant claims (packets counted by reason, which on a host's NIC never stop; unmatched requests on
        # a watched port) moves no decision. A held override or fleet share keeps a tenant moving (`still`): it stays
        # in force only while the heartbeat beats within quota.heartbeat_timeout, so the loop keeps its pace.
        return not self.view.rows_moved and self.view.still

    def _follow(self, starting: bool = False) -> None:
        assert self.datapath is not None
        self.namespaces.follow(self.datapath, self.attached, self.table, starting)

    def prepare(self, config: Config) -> Change:
        d = self.datapath
        if d is None:
            return UNCHANGED
        names = interfaces(config, self.ctx.hostfs)
        try:
            with tc.IPRoute() as ipr:
                missing = [n for n in names if tc.ifindex(ipr, n) is None]
        except OSError as e:
            raise CapabilityError(f"cannot list interfaces: {e}") from e
        if missing:
            raise CapabilityError(f"interface(s) not found: {', '.join(missing)}")
        new = _Written(config, names, self._derive(config),
                       {n: v for n, v in self.overrides.items() if n in {t.name for t in config.tenants}})
        old = _Written(self.ctx.config, self.attached, (self.specs, self.table), self.overrides)
        return rewrite(self._write, new, old, "quota maps")

    def _write(self, w: "_Written") -> None:
        d = self.datapath
        assert d is not None
        d.write_config(w.config, baseline_buckets(w.config))
        d.set_overrides(override_buckets(w.overrides, w.derived[0]))  # clamped to the floor, as the writer does
        for line in d.attach(w.interfaces, self.namespaces.names()):
            log.info("%s", line)
        self.attached = list(w.interfaces)
        self.specs, self.table = w.derived
        self.overrides = dict(w.overrides)
        self.namespaces.every.again()  # process rules may have changed: the next tick follows afresh
        self.beat.period = heartbeat_every(w.config.quota.heartbeat_timeout)  # write_config has just written one

    def _failed_start(self) -> None:
        """A start that failed leaves what it adopted enforcing (the previous agent's limits hold); a datapath of
        its own that never enforced anything goes."""
        d, self.datapath = self.datapath, None
        if d is None:
            return
        d.close()
        if not d.adopted and not d.older:
            q = self.ctx.config.quota
            for line in dp.remove_attachments(d.path, q.tc_prio, q.tc_handle, self.attached) + dp.remove_pins(d.path):
                log.info("%s", line)

    def stop(self) -> None:
        """A clean stop hands over: the filter keeps the program and the pins keep the limits, so the next agent
        adopts them with no moment unenforced (adaptive overrides expire with the heartbeat). With
        ctx.detach_on_exit it removes everything instead."""
        d = self.datapath
        if d is None:
            return
        self.datapath = None
        self.ctx.services.pop(LIMITS_SERVICE, None)
        self.ctx.services.pop(FLEET_SERVICE, None)
        q = self.ctx.config.quota
        path = d.path
        d.close()
        if not self.ctx.detach_on_exit:
            log.info("handover: filter on %s and pins at %s stay enforcing for the next agent "
                     "(qosagent detach removes them)", ", ".join(self.attached), path)
            return
        for line in dp.remove_attachments(path, q.tc_prio, q.tc_handle, self.attached) + dp.remove_pins(path):
            log.info("%s", line)

    def kernel_maps(self, plan: Any) -> list[Any]:
        return dp.map_sizes(self.ctx.config, mapsize.possible_cpus(self.ctx.hostfs))

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        """What a dead agent left: ours and what an agent of another layout left (an upgrade that never started)."""
        cfg = ctx.config
        names = list(cfg.quota.interfaces) or ["lo"]
        done = []
        # Ours last: removing the last pin directory removes the pin root too.
        for path in [*dp.other_layouts(cfg.bpf.pin_root), dp.pin_dir(cfg)]:
            done += dp.remove_attachments(path, cfg.quota.tc_prio, cfg.quota.tc_handle, names) + dp.remove_pins(path)
        return done

    # ---- visibility --------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        part = snapshot.part(QUOTA)
        return export.metrics(part, shown) if part is not None else ()

    def traffic(self, snapshot: Snapshot) -> Mapping[str, tuple[int, ...]]:
        part = snapshot.part(QUOTA)
        return export.traffic(part) if part is not None else {}

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part = snapshot.part(QUOTA)
        return export.status(part) if part is not None else {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)

    @staticmethod
    def attention(status: dict[str, Any]) -> dict[str, Attention]:
        return export.attention(status)
