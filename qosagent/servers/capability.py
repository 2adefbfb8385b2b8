"""The inference servers' own view of their load (KV cache, queue): read only, for admission and the operator.

It collects and reports; it decides nothing. Reads run on a thread of their own (scraper.py), so a slow or dead
server never delays a tick; collect() copies the latest readings into the Snapshot.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any, Container, Iterable

from prometheus_client.core import Metric

from qosagent import sandbox
from qosagent.capability import UNCHANGED, Capability, Change, State, Verdict, rewrite
from qosagent.retention import EVERYONE
from qosagent.sandbox import Need
from qosagent.servers import export
from qosagent.gpu.backend import GPU
from qosagent.servers.model import SERVERS, ServersPart
from qosagent.servers.scraper import Scraper
from qosagent.snapshot import Snapshot

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.features import Features


class Servers(Capability):
    name = "servers"

    def __init__(self, ctx: Any):
        super().__init__(ctx)
        cfg = ctx.config
        self.scraper = Scraper(ctx.hostfs, cfg.servers, cfg.watched_ports(), clock=ctx.clock)

    @classmethod
    def enabled(cls, config: "Config") -> bool:
        # No list: discover on the watched ports; an empty list: no servers to read.
        return config.servers is None or bool(config.servers)

    @classmethod
    def sandbox_needs(cls, config: "Config") -> list[Need]:
        # Configured servers too: a new pid on a port (a restart) is told by the socket's holder.
        return sandbox.other_processes("find the process that listens on a port by its socket (/proc/PID/fd)",
                                       fds=True)

    def probe(self, features: "Features") -> Verdict:
        cfg = self.ctx.config
        problems = []
        notes = []
        if not self.ctx.hostfs.exists("/proc/net/tcp"):
            if not cfg.servers:
                # A host snapshot, a --host-root without /proc: nothing to find, which is no fault of the agent.
                return Verdict(State.IDLE, "no /proc/net/tcp under the host root: no server can be found on the "
                                           "watched ports (list them under servers: to read them)")
            notes.append("no /proc/net/tcp: servers cannot be told apart by process; only configured ones are read")
        # The agent's reads are HTTP requests too: on a port a tenant claims whole, they would count as that
        # tenant's, and its quota would refuse them exactly when the tenant is cut.
        claimed = {p: t.name for t in cfg.tenants if not t.match.cidrs and not t.match.header for p in t.match.ports}
        for t in self.scraper.targets.values():
            port = urllib.parse.urlsplit(t.url).port
            if port in claimed:
                problems.append(f"server {t.cfg.port}: its metrics are read on port {port}, which tenant "
                                f"{claimed[port]!r} claims whole: the reads would count (and be limited) as its "
                                f"requests; serve the metrics on another port (servers[].metrics) or match the "
                                f"tenant by cidrs or header")
        if problems:
            return Verdict(State.DEGRADED, "; ".join(problems))
        how = "configured" if cfg.servers else "found on the watched ports"
        return Verdict(State.ACTIVE, "; ".join([f"reads the inference servers' metrics ({how})"] + notes))

    def start(self, plan: None = None) -> None:
        self.scraper.start()

    def prepare(self, config: "Config") -> Change:
        """A reload that changes the watched ports (tenants' ports, latency.ports) moves discovery onto them."""
        old, new = self.ctx.config.watched_ports(), config.watched_ports()
        if not self.scraper.discover or new == old:
            return UNCHANGED
        return rewrite(self.scraper.watch, new, old, "ports servers are discovered on")

    def stop(self) -> None:
        self.scraper.stop()

    def collect(self) -> ServersPart:
        return self.scraper.part()

    def quiet(self) -> bool:
        # Its thread reads the servers on servers[].interval whatever the loop's pace; the tick only hands the
        # latest reading on, and what a reading means for a decision is admission's to say (its own quiet).
        return True

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable[Metric]:
        part = snapshot.part(SERVERS)
        return export.metrics(part, snapshot.part(GPU)) if part is not None else ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        return export.status(snapshot.part(SERVERS), snapshot.part(GPU), self.ctx.config.servers is None)

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        return export.render(status)
