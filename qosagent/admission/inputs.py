"""From one Snapshot and the config to the decision's inputs (pure: reads only what it is given)."""

from __future__ import annotations

from typing import Mapping

from qosagent.admission.policy import GpuInput, ServerInput, TenantInput, TickInput, TierInput
from qosagent.config import Config, LimitSpec
from qosagent.gpu.backend import GpuState
from qosagent.hist import Histogram
from qosagent.latency.model import LatencyPart
from qosagent.quota.model import QuotaPart
from qosagent.quota.rules import baseline as quota_baseline
from qosagent.quota.rules import limit_of
from qosagent.servers.model import ServersPart
from qosagent.snapshot import Snapshot
from qosagent.tenants import TenantLimit


def config_baseline(cfg: Config) -> dict[str, TenantLimit]:
    """Configured request limits when no quota capability answers for them: read exactly as the classifier
    would (each field from the tenant, else its tier; the same burst default), so dry-run shows real numbers."""
    return {name: spec.requests for name, spec in quota_baseline(cfg).items() if spec.requests is not None}


def _floor_burst(floor: LimitSpec | None) -> int:
    # Read as the quota writer reads the floor.
    if floor is None or not floor.rps:
        return 0
    return limit_of(floor.rps, floor.burst).burst


def _preallocated(servers: ServersPart | None, gpu: GpuState, index: int) -> str:
    """Why GPU index's memory is not load, or "": a pre-allocating server (vLLM, SGLang, TGI, TensorRT-LLM) takes
    most of its GPUs' memory at start, so memory used there sits near its configured fraction whatever the load;
    the server's own KV-cache usage is the reading that moves with load (docs/admission.md, "GPU memory")."""
    sample = gpu.by_index(index)
    if servers is None or not servers.processes_known or sample is None:
        return ""  # no process table to tell by (servers off, or no /proc): memory is load, as before servers
    if any(e[0] == "processes" for e in sample.errors):
        if not servers.preallocating_pids:
            return ""
        # Pre-allocating servers run here, but which GPUs they hold cannot be told: memory is no evidence anywhere.
        return "held by a pre-allocating server? (process list unreadable)"
    on = {p.pid for p in sample.processes}
    pids = on & servers.preallocating_pids
    if pids:
        ports = sorted(s.port for s in servers.servers if s.pids & pids)
        return "held by pre-allocating server " + (", ".join(map(str, ports)) if ports else f"pid {min(pids)}")
    new = on - servers.known_pids
    if new:
        # Started since the last walk of /proc (a server loading its model takes its memory in those seconds).
        return f"process {min(new)} on it not identified yet"
    return ""


def gpu_input(gpu: GpuState | None, serving: list[int], servers: ServersPart | None = None) -> GpuInput:
    """The highest memory ratio over the serving GPUs that answered and that no pre-allocating server holds;
    unknown when none is left."""
    if gpu is None or not gpu.available:
        return GpuInput.unknown(gpu.reason if gpu is not None else "no GPU data")
    wanted = serving or [g.index for g in gpu.gpus]
    best: tuple[float, int] | None = None
    missing = []
    for index in wanted:
        held = _preallocated(servers, gpu, index)
        if held:
            missing.append(f"GPU {index} {held}")
            continue
        sample = gpu.by_index(index)
        ratio = sample.memory_used_ratio if sample is not None and not sample.lost else None
        if ratio is None:
            why = "absent" if sample is None else "lost" if sample.lost else \
                ",".join(f"{f}:{k}" for f, k in sample.errors) or "no memory reading"
            missing.append(f"GPU {index} {why}")
            continue
        if best is None or ratio > best[0]:
            best = (ratio, index)
    if best is None:
        return GpuInput.unknown("; ".join(missing) or "no serving GPU")
    return GpuInput(True, best[0], best[1], "; ".join(missing))


def tick_input(snap: Snapshot, cfg: Config, baseline: Mapping[str, TenantLimit]) -> TickInput:
    policy = cfg.admission
    lat: LatencyPart | None = snap.part("latency")
    quota: QuotaPart | None = snap.part("quota")
    lat_tenants = lat.tenants if lat is not None else {}
    quota_tenants = quota.tenants if quota is not None else {}

    # Summed in place: chaining Histogram.__add__ copies the growing tier total once per tenant.
    windows: dict[str, dict[int, int]] = {}
    tenants: dict[str, TenantInput] = {}
    for t in cfg.tenants:
        tl = lat_tenants.get(t.name)
        tq = quota_tenants.get(t.name)
        if tl is not None:
            h = tl.window(policy.signal)
            acc = windows.setdefault(t.tier, {})
            for i, c in h.counts.items():
                acc[i] = acc.get(i, 0) + c
        floor = cfg.tiers[t.tier].floor
        # Admitted rate from the classifier when quota runs; otherwise what completed, as the next best guess.
        admitted = tq.admitted_rps if tq is not None else tl.rate_rps if tl is not None else None
        tenants[t.name] = TenantInput(
            name=t.name,
            tier=t.tier,
            baseline=baseline.get(t.name),
            floor_rps=(floor.rps or 0.0) if floor is not None else 0.0,
            floor_burst=_floor_burst(floor),
            admitted_rps=admitted,
            dropped_rps=tq.dropped_rps if tq is not None else None,
            in_flight=tl.in_flight if tl is not None else None,
            sheddable=cfg.tiers[t.tier].sheddable,
            ports=frozenset(t.match.ports),
        )
    tiers = {}
    for name in sorted({t.tier for t in cfg.tenants}):
        tier = cfg.tiers[name]
        observed = Histogram(windows[name]).quantile(policy.quantile) if name in windows else None
        tiers[name] = TierInput(name, tier.weight, tier.slo_p99, observed)
    rq = lat.runqueue_window if lat is not None else None
    servers: ServersPart | None = snap.part("servers")
    return TickInput(
        now=snap.monotonic,
        tiers=tiers,
        tenants=tenants,
        gpu=gpu_input(snap.part("gpu"), policy.gpu_pressure.gpus, servers),
        servers=tuple(ServerInput(s.port, s.kind, s.known, s.kv_cache_usage, s.requests_waiting)
                      for s in (servers.servers if servers is not None else ())),
        runqueue_p99=rq.quantile(0.99) if rq is not None else None,
        window_s=lat.window_s if lat is not None else cfg.latency.window,
    )
