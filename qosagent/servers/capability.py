"""The inference servers' own view of their load (KV cache, queue): read only, for admission and the operator.

It collects and reports; it decides nothing. Reads run on a thread of their own (scraper.py), so a slow or dead
server never delays a tick; collect() copies the latest readings into the Snapshot.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from qosagent.capability import UNCHANGED, Capability, Change, State, Verdict, rewrite
from qosagent.servers.model import ServersPart, gpu_holders
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

    # ---- reporting ---------------------------------------------------------------------------------------
    def metrics(self, snapshot: Snapshot) -> Iterable[Metric]:
        part: ServersPart | None = snapshot.part(self.name)
        if part is None:
            return
        labels = ["port", "kind"]
        known = GaugeMetricFamily("qosagent_server_reading_known", "1 while the server's reading is fresh and "
                                  "usable; 0: unknown (down, slow, garbage, stale), nothing decided on it",
                                  labels=labels)
        kv = GaugeMetricFamily("qosagent_server_kv_cache_usage_ratio", "Share of the server's KV cache in use, as "
                               "the server reports it", labels=labels)
        waiting = GaugeMetricFamily("qosagent_server_requests_waiting", "Requests queued in the server",
                                    labels=labels)
        running = GaugeMetricFamily("qosagent_server_requests_running", "Requests the server is running",
                                    labels=labels)
        preempt = CounterMetricFamily("qosagent_server_preemptions", "The server's own count of preempted "
                                      "(vLLM) or retracted (SGLang) requests", labels=labels)
        tps = GaugeMetricFamily("qosagent_server_generated_tokens_per_second", "Tokens the server generated per "
                                "second between the agent's last two reads (its own counter's rate)", labels=labels)
        age = GaugeMetricFamily("qosagent_server_reading_age_seconds", "Since the server's last good read",
                                labels=labels)
        scrapes = CounterMetricFamily("qosagent_server_reads", "Reads of the server's metrics by result",
                                      labels=[*labels, "result"])
        restarts = CounterMetricFamily("qosagent_server_restarts", "Server restarts seen (new pid on the port, or "
                                       "a new process_start_time_seconds)", labels=labels)
        resets = CounterMetricFamily("qosagent_server_counter_resets", "Counters of the server seen going "
                                     "backwards", labels=labels)
        for s in part.servers:
            lv = [str(s.port), s.kind]
            known.add_metric(lv, 1.0 if s.known else 0.0)
            for fam, value in ((kv, s.kv_cache_usage), (waiting, s.requests_waiting), (running, s.requests_running),
                               (preempt, s.preemptions), (tps, s.generated_tokens_per_second), (age, s.age_s)):
                if value is not None and (s.known or fam is age):
                    fam.add_metric(lv, value)
            for result, n in sorted(s.scrapes.items()):
                scrapes.add_metric([*lv, result], n)
            restarts.add_metric(lv, s.restarts)
            resets.add_metric(lv, s.counter_resets)
        yield from (known, kv, waiting, running, preempt, tps, age, scrapes, restarts, resets)
        holders = GaugeMetricFamily("qosagent_server_gpu_holders", "Known servers whose processes hold the GPU "
                                    "(NVML's process list); above 1: servers share it", labels=["gpu"])
        for gpu, ports in sorted(gpu_holders(part, snapshot.part("gpu")).items()):
            holders.add_metric([str(gpu)], len(ports))
        yield holders
        yield CounterMetricFamily("qosagent_server_round_errors", "Rounds of reading the servers that failed "
                                  "unexpectedly (logged with the cause); the next round runs as usual",
                                  value=part.round_errors)

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        part: ServersPart | None = snapshot.part(self.name)
        if part is None:
            return {"servers": [], "shared_gpus": {}}
        shared = {str(g): ports for g, ports in gpu_holders(part, snapshot.part("gpu")).items() if len(ports) > 1}
        return {
            "discovered": self.ctx.config.servers is None,
            "servers": [{
                "port": s.port, "kind": s.kind, "url": s.url, "pid": s.pid, "configured": s.configured,
                "preallocates": s.preallocates, "known": s.known, "reason": s.reason,
                "age_s": s.age_s, "kv_cache_usage": s.kv_cache_usage, "requests_waiting": s.requests_waiting,
                "requests_running": s.requests_running, "preemptions": s.preemptions,
                "generated_tokens_per_second": s.generated_tokens_per_second, "missing": dict(s.missing),
                "reads": dict(s.scrapes), "restarts": s.restarts, "counter_resets": s.counter_resets,
            } for s in part.servers],
            "shared_gpus": shared,
        }

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        if "servers" not in status:
            return f"SERVERS  {status.get('error', 'no status')}"
        how = "found on the watched ports" if status.get("discovered") else "configured"
        lines = [f"SERVERS  {how}",
                 "PORT   KIND      PID      KV      WAITING  RUNNING  PREEMPT  TOK/S    AGE     STATE"]

        def num(v: float | None, fmt: str = "{:g}") -> str:
            return "-" if v is None else fmt.format(v)

        for s in status["servers"]:
            state = "ok" if s["known"] and not s["reason"] else ("ok, " if s["known"] else "UNKNOWN: ") + s["reason"]
            if s["known"] and s["missing"]:
                state += "  (" + "; ".join(f"{k}: {v}" for k, v in s["missing"].items()) + ")"
            lines.append(f"{s['port']:<6} {s['kind']:<9} {num(s['pid']):<8} {num(s['kv_cache_usage'], '{:.0%}'):<7} "
                         f"{num(s['requests_waiting']):<8} {num(s['requests_running']):<8} "
                         f"{num(s['preemptions']):<8} {num(s.get('generated_tokens_per_second'), '{:.0f}'):<8} "
                         f"{num(s['age_s'], '{:.1f}s'):<7} {state}")
        for gpu, ports in status.get("shared_gpus", {}).items():
            lines.append(f"GPU {gpu} is shared by the servers on ports {', '.join(map(str, ports))}")
        if not status["servers"]:
            lines.append("(none)")
        return "\n".join(lines)
