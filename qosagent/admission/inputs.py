"""From one Snapshot and the config to the decision's inputs (pure: reads only what it is given)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from qosagent.admission.policy import (
    MEMORY_EVIDENCE,
    MISSING_EVIDENCE,
    SERVER_EVIDENCE,
    UNKNOWN_EVIDENCE,
    GpuInput,
    GpuReading,
    ServerInput,
    TenantInput,
    TickInput,
    TierInput,
)
from qosagent.config import Config, LimitSpec, TenantConfig
from qosagent.gpu.backend import GPU, GpuSample, GpuState
from qosagent.latency.model import LATENCY, LatencyPart, TenantLatency
from qosagent.quota.model import QUOTA, TenantQuota
from qosagent.resources.model import RESOURCES
from qosagent.servers.model import SERVERS, ServerReading, ServersPart
from qosagent.slo import SloVerdict, tier_slos
from qosagent.snapshot import Snapshot
from qosagent.tenants import TenantLimit, limit_of
from qosagent.tenants import baseline as quota_baseline


def config_baseline(cfg: Config) -> dict[str, TenantLimit]:
    """Configured request limits when no quota capability answers for them: read exactly as the classifier
    would (each field from the tenant, else its tier; the same burst default), so dry-run shows real numbers."""
    return {name: spec.requests for name, spec in quota_baseline(cfg).items() if spec.requests is not None}


def baseline(snap: Snapshot, cfg: Config) -> dict[str, TenantLimit]:
    """Each tenant's configured request limit, as this tick's quota part carries it (what the kernel falls back to
    when the heartbeat expires); read from the config the same way where quota does not run."""
    quota = snap.part(QUOTA)
    if quota is not None:
        return {name: t.baseline for name, t in quota.tenants.items() if t.baseline is not None}
    return config_baseline(cfg)


def _floor_burst(floor: LimitSpec | None) -> int:
    # Read as the quota writer reads the floor.
    if floor is None or not floor.rps:
        return 0
    return limit_of(floor.rps, floor.burst).burst


def _may_use(pids: frozenset[int], sample: GpuSample, placed: frozenset[int]) -> bool:
    """Whether processes may use a GPU: NVML lists one of them on it, or it cannot tell where they are (its process
    list unreadable there, or none of them listed on any GPU: an empty list inside a container, PIDs of another PID
    namespace, a MIG or vGPU slice, a server whose processes the agent cannot see)."""
    if not pids or any(f == "processes" for f, _ in sample.errors):
        return True
    return bool(pids & {p.pid for p in sample.processes}) or not pids & placed


def _server_says(readings: list[ServerReading]) -> tuple[str, float | None]:
    """What the servers with a reading report, as status shows it, and their highest KV-cache usage."""
    kvs = [s.kv_cache_usage for s in readings if s.kv_cache_usage is not None]
    kv = max(kvs) if kvs else None
    ports = ", ".join(str(s.port) for s in readings)
    who = "the server reports" if len(readings) == 1 else "the servers report"
    if kv is not None:
        said = f"KV {kv * 100:.0f} %" if len(readings) == 1 else f"KV up to {kv * 100:.0f} %"
    else:
        said = f"{max(s.requests_waiting or 0 for s in readings):g} waiting"
    return f"{who} {said} on port{'s' if len(readings) > 1 else ''} {ports}", kv


def _evidence(servers: ServersPart | None, gpu: GpuState, sample: GpuSample) -> tuple[str, str, float | None]:
    """Evidence before GPU memory: (evidence, why, KV) for one GPU. A server that may use it and reports its KV
    cache or queue speaks for it; one that may use it with no reading, a pre-allocating process with no server
    reading, or a process the agent cannot identify leaves it without evidence; otherwise memory is all there is."""
    i = sample.index
    if servers is None:
        return MEMORY_EVIDENCE, "", None  # servers: [] (or off): memory is load, as before servers were read
    readable = [g for g in gpu.gpus if not any(f == "processes" for f, _ in g.errors)]
    placed = frozenset(p.pid for g in readable for p in g.processes)
    # A generic server exports no KV cache or queue: it can neither speak for a GPU nor leave one without evidence.
    near = [s for s in servers.servers if s.kind != "generic" and _may_use(s.pids, sample, placed)]
    read = [s for s in near if s.known and (s.kv_cache_usage is not None or s.requests_waiting is not None)]
    if read:
        why, kv = _server_says(read)
        return SERVER_EVIDENCE, why, kv
    if near:
        s = near[0]
        return MISSING_EVIDENCE, f"server {s.port} may use GPU {i} and has no reading: {s.reason or 'no fields'}", None
    if not servers.processes_known:
        return MEMORY_EVIDENCE, "", None
    theirs = frozenset().union(*(s.pids for s in servers.servers))
    alone = servers.preallocating_pids - theirs
    if alone and _may_use(alone, sample, placed):
        return MISSING_EVIDENCE, f"pre-allocating process {min(alone)} may use GPU {i} and no server reads it", None
    if any(f == "processes" for f, _ in sample.errors):
        return MEMORY_EVIDENCE, "", None
    new = {p.pid for p in sample.processes} - servers.known_pids
    if new:
        return MISSING_EVIDENCE, (f"process {min(new)} on GPU {i} not identified (started since the last walk of "
                                  "/proc, or in another PID namespace)"), None
    return MEMORY_EVIDENCE, "", None


def gpu_input(gpu: GpuState | None, serving: list[int], servers: ServersPart | None = None) -> GpuInput:
    """Each serving GPU's memory and the evidence beside it (docs/admission.md, "GPU memory: evidence first")."""
    if gpu is None or not gpu.available:
        return GpuInput.unknown(gpu.reason if gpu is not None else "no GPU data")
    wanted = serving or [g.index for g in gpu.gpus]
    out = []
    for index in wanted:
        sample = gpu.by_index(index)
        ratio = sample.memory_used_ratio if sample is not None and not sample.lost else None
        if sample is None or ratio is None:
            why = "absent" if sample is None else "lost" if sample.lost else \
                ",".join(f"{f}:{k}" for f, k in sample.errors) or "no memory reading"
            out.append(GpuReading(index, None, UNKNOWN_EVIDENCE, f"GPU {index} {why}"))
            continue
        evidence, why, kv = _evidence(servers, gpu, sample)
        out.append(GpuReading(index, ratio, evidence, why, kv))
    return GpuInput(tuple(out), "" if out else "no serving GPU")


def slo_verdict(lat: LatencyPart | None, cfg: Config, tier_slo: Mapping[str, float] | None = None) -> SloVerdict:
    """This tick's SLO verdict, as latency's collect judged it; judged here, by the same rule, only where the part
    has none for this config (latency off, a part built by hand, the first tick after a reload). tier_slo: cfg's
    tier_slos (worked out here when not given; the capability keeps them per config)."""
    adm = cfg.admission
    if tier_slo is None:
        tier_slo = tier_slos(cfg)
    v = lat.verdict if lat is not None else None
    if v is not None and (v.signal, v.quantile) == (adm.signal, adm.quantile) and v.tiers.keys() == tier_slo.keys():
        return v
    measured = lat.tenants if lat is not None else {}
    windows = {t.name: (t.tier, measured[t.name].window(adm.signal)) for t in cfg.tenants if t.name in measured}
    return SloVerdict(windows, {t.name: cfg.tiers[t.tier].slo_p99 for t in cfg.tenants}, tier_slo, adm.signal,
                 adm.quantile, adm.near_slo, adm.healthy_below)


class TenantInputs(Mapping[str, TenantInput]):
    """The configured tenants' inputs, in the config's order, each built when first asked for: a tick at rest asks
    only for the tenants with an adaptive limit or a shed, so the idle ones cost no object per tick. Reads only what
    it was given, as tick_input does."""

    def __init__(self, cfg: Config, lat: Mapping[str, TenantLatency], quota: Mapping[str, TenantQuota],
                 baseline: Mapping[str, TenantLimit], index: Mapping[str, TenantConfig]):
        self._cfg, self._lat, self._quota, self._baseline, self._index = cfg, lat, quota, baseline, index
        self._built: dict[str, TenantInput] = {}

    def __getitem__(self, name: str) -> TenantInput:
        got = self._built.get(name)
        if got is None:
            got = self._built[name] = self._build(self._index[name])
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def _build(self, t: TenantConfig) -> TenantInput:
        tl = self._lat.get(t.name)
        tq = self._quota.get(t.name)
        tier = self._cfg.tiers[t.tier]
        floor = tier.floor
        # Admitted rate from the classifier when quota runs; otherwise what completed, as the next best guess.
        admitted = tq.admitted_rps if tq is not None else tl.rate_rps if tl is not None else None
        return TenantInput(
            name=t.name,
            tier=t.tier,
            baseline=self._baseline.get(t.name),
            floor_rps=(floor.rps or 0.0) if floor is not None else 0.0,
            floor_burst=_floor_burst(floor),
            admitted_rps=admitted,
            dropped_rps=tq.dropped_rps if tq is not None else None,
            in_flight=tl.in_flight if tl is not None else None,
            sheddable=tier.sheddable,
            ports=frozenset(t.match.ports),
        )


# Every part tick_input reads of the snapshot (besides its time): the same parts as the last tick's give the same
# input. Latency's and quota's by identity: at rest they are the parts of the tick before, handed on, and comparing
# their tenants' rows by value would cost what it saves; the small ones by value (the servers' is made anew each tick,
# and while a server is read its readings' age_s moves, so then the input is always built again).
INPUT_PARTS = (LATENCY, QUOTA, SERVERS, RESOURCES, GPU)
_BY_IDENTITY = 2


def same_parts(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two ticks' INPUT_PARTS give tick_input the same input."""
    return all(x is y for x, y in zip(a[:_BY_IDENTITY], b[:_BY_IDENTITY])) and a[_BY_IDENTITY:] == b[_BY_IDENTITY:]


def tick_input(snap: Snapshot, cfg: Config, baseline: Mapping[str, TenantLimit],
               index: Mapping[str, TenantConfig] | None = None,
               tier_slo: Mapping[str, float] | None = None) -> TickInput:
    """index: cfg's tenants by name, tier_slo its tier_slos (each made here when not given; the capability keeps
    them per config)."""
    policy = cfg.admission
    lat = snap.part(LATENCY)
    quota = snap.part(QUOTA)
    tenants = TenantInputs(cfg, lat.tenants if lat is not None else {}, quota.tenants if quota is not None else {},
                           baseline, index if index is not None else {t.name: t for t in cfg.tenants})
    verdict = slo_verdict(lat, cfg, tier_slo)
    tiers = {name: TierInput(name, cfg.tiers[name].weight, v, cfg.tiers[name].sheddable)
             for name, v in verdict.tiers.items()}
    rq = lat.runqueue_window if lat is not None else None
    servers = snap.part(SERVERS)
    res = snap.part(RESOURCES)
    return TickInput(
        now=snap.monotonic,
        tiers=tiers,
        tenants=tenants,
        gpu=gpu_input(snap.part(GPU), policy.gpu_pressure.gpus, servers),
        servers=tuple(ServerInput(s.port, s.kind, s.known, s.kv_cache_usage, s.requests_waiting)
                      for s in (servers.servers if servers is not None else ())),
        runqueue_p99=rq.quantile(0.99) if rq is not None else None,
        window_s=lat.window_s if lat is not None else cfg.latency.window,
        cpu_held=res.cpu_held if res is not None else frozenset(),
    )
