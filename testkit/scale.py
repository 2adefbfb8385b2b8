"""A node with many tenants, built without BPF: the Snapshot parts latency, quota and admission would publish for N
configured tenants of which a few have traffic. The exports and `qosagent status` read only the Snapshot, so what a
scrape or a status costs at that size is measured on it (bench/scale_tenants.py) and bounded in the unit tests.

Tenants are t0000, t0001, ... over the default tiers (gold, silver, bronze in turn); the active ones are the first
`active`, each with its own lognormal latencies (its `scale` sets how many requests)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from qosagent import config as config_mod
from qosagent.admission.capability import Admission
from qosagent.admission.model import AdmissionPart, TenantAdmission, TierAdmission
from qosagent.capability import State, Verdict
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hist import Histogram
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from qosagent.latency.model import Hooks, LatencyPart, TenantLatency
from qosagent.quota.capability import Quota
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.snapshot import Snapshot
from qosagent.tenants import TenantLimit

TIERS = ("gold", "silver", "bronze")
EMPTY = Histogram()


def name(i: int) -> str:
    return f"t{i:04d}"


def tier(i: int) -> str:
    return TIERS[i % len(TIERS)]


def latencies(seed: int, n: int, median_s: float = 0.045, sigma: float = 0.5) -> Histogram:
    rng = random.Random(seed)
    return Histogram.of(int(rng.lognormvariate(math.log(median_s * 1e9), sigma)) for _ in range(n))


def tenant_latency(i: int, requests: int) -> TenantLatency:
    """Tenant i after `requests` requests (0: configured, never seen), its window the last tenth of them."""
    if not requests:
        return TenantLatency(name(i), tier(i), 0, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY, 0.0)
    total, window = latencies(i, requests), latencies(i + 100_000, max(requests // 10, 1))
    tokens = latencies(i + 200_000, requests * 20, 0.02, 0.3)
    return TenantLatency(name(i), tier(i), requests, total, total, total, tokens, window, window, window,
                         latencies(i + 300_000, max(requests * 2, 1), 0.02, 0.3), rate_rps=window.count / 10,
                         in_flight=1, connections=max(requests // 50, 1), framed=requests)


def parts(tenants: int, requests: dict[int, int]) -> dict[str, Any]:
    """The latency, quota and admission parts of a node with `tenants` configured; requests: tenant index -> its
    requests since start (the others have none)."""
    lat = {name(i): tenant_latency(i, requests.get(i, 0)) for i in range(tenants)}
    base = TenantLimit(100, 200)
    quota = {name(i): TenantQuota(name(i), tier(i), base, base, requests.get(i, 0), 0,
                                  max(requests.get(i, 0) // 50, 0), 0, admitted_rps=requests.get(i, 0) / 100,
                                  bucket_tokens=200.0) for i in range(tenants)}
    adm = tuple(TenantAdmission(name(i), tier(i), base, base, False, True, "config", "baseline")
                for i in range(tenants))
    return {
        "latency": LatencyPart(10.0, lat, hooks=Hooks("tracepoint", 6)),
        "quota": QuotaPart(tenants=quota, interfaces=("lo",), pins="/sys/fs/bpf/qosagent"),
        "admission": AdmissionPart(decided=True, mode="dry-run", enforcing=False, quantile=0.95, signal="ttft",
                                   tiers=tuple(TierAdmission(t, 0.05, 0.1, 0, False, False) for t in TIERS),
                                   tenants=adm),
    }


def agent(root: Path, config: dict[str, Any] | None = None) -> Agent:
    """An agent with latency, quota (on) and admission (dry-run) as capabilities, none started: its latest Snapshot
    is what the caller publishes (publish())."""
    cfg = config_mod.parse({"quota": {"enabled": True}, "admission": {"enabled": True, "mode": "dry-run"},
                            **(config or {})}, "scale")
    a = Agent(cfg, HostFS(root), gpu=NoGpu("scale"))
    a.capabilities = [cls(a.ctx) for cls in (Quota, Latency, Admission)]
    for cap in a.capabilities:
        a.verdicts[cap.name] = Verdict(State.ACTIVE)
    return a


def publish(a: Agent, at: float, tenants: int, requests: dict[int, int]) -> Snapshot:
    """A new Snapshot of the node at monotonic time `at`, made the agent's latest (as a tick does)."""
    snap = Snapshot.build(a.latest.seq + 1, at, 1_700_000_000.0 + at, parts(tenants, requests))
    a.latest = snap
    return snap
