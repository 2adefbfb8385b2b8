"""The servers capability's part of the Snapshot: one reading per inference server, known or unknown with why."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from qosagent.gpu.backend import GpuState
from qosagent.snapshot import PartKey


@dataclass(frozen=True)
class ServerReading:
    port: int
    kind: str  # as configured, else as found (command line, then metric names); generic when neither says
    url: str
    configured: bool  # from `servers:`, not discovered
    known: bool  # a good read younger than stale_after; nothing is decided on an unknown reading
    reason: str = ""  # why unknown, or the last failure while the reading is still fresh
    age_s: float | None = None  # since the last good read
    pid: int | None = None  # the process that listens on the port, when /proc says
    pids: frozenset[int] = frozenset()  # it, the server processes above it, and all their descendants
    preallocates: bool = False
    kv_cache_usage: float | None = None  # 0-1
    requests_waiting: float | None = None
    requests_running: float | None = None
    preemptions: float | None = None  # the server's own counter
    # Its generated-tokens counter's rate over the last generated_tokens_window_s seconds of reads (the kind's
    # rate_window, or between the last two reads).
    generated_tokens_per_second: float | None = None
    generated_tokens_window_s: float | None = None
    missing: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # field -> why unknown
    scrapes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # result -> count
    restarts: int = 0
    counter_resets: int = 0


@dataclass(frozen=True)
class ServersPart:
    servers: tuple[ServerReading, ...] = ()
    # Every process of a pre-allocating server on the host (command line, and descendants): memory used on a GPU
    # one of them holds is the server's reservation, not load.
    preallocating_pids: frozenset[int] = frozenset()
    processes_known: bool = False  # /proc was read; without it no GPU can be attributed to a server
    # Every pid /proc showed at the last walk: a GPU process not among them started since, and is not identified yet.
    known_pids: frozenset[int] = frozenset()
    round_errors: int = 0  # read rounds that failed on a bug of ours (logged); the readings go on


def gpu_holders(part: ServersPart | None, gpu: GpuState | None) -> dict[int, list[int]]:
    """GPU index -> ports of the known servers whose processes NVML lists on it (two means two servers share it)."""
    out: dict[int, list[int]] = {}
    if part is None or gpu is None or not gpu.available:
        return out
    for g in gpu.gpus:
        on = {p.pid for p in g.processes}
        ports = sorted(s.port for s in part.servers if s.pids & on)
        if ports:
            out[g.index] = ports
    return out


SERVERS = PartKey("servers", ServersPart)
