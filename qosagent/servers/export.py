"""What servers shows: its metrics, its `qosagent status` part and the CLI's rendering of it, from the part (and
the tick's GPU sample, for which servers share a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client.core import Metric

from qosagent.exposition import Family, Series, families, one
from qosagent.gpu.backend import GpuState
from qosagent.servers.model import ServerReading, ServersPart, gpu_holders

LABELS = ("port", "kind")


@dataclass(frozen=True)
class Source:
    part: ServersPart
    gpu: GpuState | None


def _lv(s: ServerReading) -> list[str]:
    return [str(s.port), s.kind]


def _each(value: Callable[[ServerReading], Any]) -> Callable[[Source], Series]:
    """A series per server."""
    return lambda src: ((_lv(s), value(s)) for s in src.part.servers)


def _known(value: Callable[[ServerReading], Any]) -> Callable[[Source], Series]:
    """A series per server whose reading is known and has the value: nothing is shown of an unknown reading."""
    return lambda src: ((_lv(s), v) for s in src.part.servers if s.known and (v := value(s)) is not None)


def _reads(src: Source) -> Series:
    return (([*_lv(s), result], n) for s in src.part.servers for result, n in sorted(s.scrapes.items()))


FAMILIES: tuple[Family[Source], ...] = (
    Family("qosagent_server_reading_known", "gauge", "1 while the server's reading is fresh and usable; 0: unknown "
           "(down, slow, garbage, stale), nothing decided on it", LABELS, _each(lambda s: 1.0 if s.known else 0.0)),
    Family("qosagent_server_kv_cache_usage_ratio", "gauge", "Share of the server's KV cache in use, as the server "
           "reports it", LABELS, _known(lambda s: s.kv_cache_usage)),
    Family("qosagent_server_requests_waiting", "gauge", "Requests queued in the server", LABELS,
           _known(lambda s: s.requests_waiting)),
    Family("qosagent_server_requests_running", "gauge", "Requests the server is running", LABELS,
           _known(lambda s: s.requests_running)),
    Family("qosagent_server_preemptions", "counter", "The server's own count of preempted (vLLM) or retracted "
           "(SGLang) requests", LABELS, _known(lambda s: s.preemptions)),
    Family("qosagent_server_generated_tokens_per_second", "gauge", "Tokens the server generated per second: its own "
           "counter's rate between the agent's last two reads, or over the kind's window (llamacpp: 10 s)", LABELS,
           _known(lambda s: s.generated_tokens_per_second)),
    Family("qosagent_server_reading_age_seconds", "gauge", "Since the server's last good read", LABELS,
           lambda src: ((_lv(s), s.age_s) for s in src.part.servers if s.age_s is not None)),
    Family("qosagent_server_reads", "counter", "Reads of the server's metrics by result", (*LABELS, "result"),
           _reads),
    Family("qosagent_server_restarts", "counter", "Server restarts seen (new pid on the port, or a new "
           "process_start_time_seconds)", LABELS, _each(lambda s: s.restarts)),
    Family("qosagent_server_counter_resets", "counter", "Counters of the server seen going backwards", LABELS,
           _each(lambda s: s.counter_resets)),
    Family("qosagent_server_gpu_holders", "gauge", "Known servers whose processes hold the GPU (NVML's process "
           "list); above 1: servers share it", ("gpu",),
           lambda src: (([str(g)], len(ports)) for g, ports in sorted(gpu_holders(src.part, src.gpu).items()))),
    Family("qosagent_server_round_errors", "counter", "Rounds of reading the servers that failed unexpectedly "
           "(logged with the cause); the next round runs as usual", (), one(lambda src: src.part.round_errors)),
)


def metrics(part: ServersPart, gpu: GpuState | None) -> Iterable[Metric]:
    return families(FAMILIES, Source(part, gpu))


def status(part: ServersPart | None, gpu: GpuState | None, discovered: bool) -> dict[str, Any]:
    """discovered: the servers are found on the watched ports (no `servers:` list)."""
    if part is None:
        return {"servers": [], "shared_gpus": {}}
    shared = {str(g): ports for g, ports in gpu_holders(part, gpu).items() if len(ports) > 1}
    return {
        "discovered": discovered,
        "servers": [{
            "port": s.port, "kind": s.kind, "url": s.url, "pid": s.pid, "configured": s.configured,
            "preallocates": s.preallocates, "known": s.known, "reason": s.reason,
            "age_s": s.age_s, "kv_cache_usage": s.kv_cache_usage, "requests_waiting": s.requests_waiting,
            "requests_running": s.requests_running, "preemptions": s.preemptions,
            "generated_tokens_per_second": s.generated_tokens_per_second,
            "generated_tokens_window_s": s.generated_tokens_window_s, "missing": dict(s.missing),
            "reads": dict(s.scrapes), "restarts": s.restarts, "counter_resets": s.counter_resets,
        } for s in part.servers],
        "shared_gpus": shared,
    }


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
