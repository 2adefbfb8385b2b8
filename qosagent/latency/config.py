from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from qosagent.configbase import Duration, Port, Section


class RunqueueConfig(Section):
    # Run-queue latency of the processes that serve the watched ports (learned from their socket events).
    enabled: bool = True


class LatencyConfig(Section):
    enabled: bool = True
    # Which kernel hooks time requests (docs/latency.md, "Modes"). auto: sockops where the kernel has the per-socket
    # sendmsg callback (>= 6.15) and a cgroup v2 hierarchy, else tracepoint, else kprobe. sockops costs nothing on
    # sockets that are not served on watched ports; tracepoint also tells pipelined HTTP/1.1 requests apart.
    mode: Literal["auto", "sockops", "tracepoint", "kprobe"] = "auto"
    # vLLM and Triton HTTP serve on 8000 (Triton gRPC on 8001), TGI on 8080 in its container and 3000 by default
    # when launched by hand. Sockets on these ports are measured even when no tenant claims them ("unmatched").
    ports: list[Port] = Field(default_factory=lambda: [8000, 8001, 8080, 3000])
    # Ports whose protocol runs several requests at once on one connection (HTTP/2, gRPC: Triton's 8001). Socket
    # events carry no payload, so such requests cannot be told apart: these connections are counted, not timed.
    multiplexed_ports: list[Port] = Field(default_factory=lambda: [8001])
    window: Duration = 10.0
    # Server-side connections tracked at once in tracepoint and kprobe modes: slots of the kernel's socket table (a
    # power of two; sockops mode keeps state on the socket itself and needs no table). A connection
    # whose bucket of four slots is full is counted as untracked: ~0.3 % of them at a sixth of the slots in use.
    socket_slots: int = 65536
    runqueue: RunqueueConfig = RunqueueConfig()

    @field_validator("socket_slots")
    @classmethod
    def _socket_slots(cls, v: int) -> int:
        if v < 4 or v > 1 << 22 or v & (v - 1):
            raise ValueError("expected a power of two from 4 to 4194304")
        return v

    @field_validator("window")
    @classmethod
    def _window(cls, v: float) -> float:
        if not 1.0 <= v <= 3600.0:
            raise ValueError("expected between 1s and 1h")
        return v
