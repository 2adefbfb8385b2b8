from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from qosagent.configbase import RESTART, Duration, Port, Section, duration_between


class RunqueueConfig(Section):
    # Run-queue latency of the processes that serve the watched ports (learned from their socket events).
    enabled: Annotated[bool, RESTART] = True


class ClassicBucketsConfig(Section):
    # The `le` edges of the latency histograms for scrapers that take classic buckets (text exposition). Scrapers
    # that ask for protobuf also get the native histogram, which needs none of this. Each edge is an exact edge of the
    # internal layout (16 per power of two), so 1, 2, 4, 8 or 16 per power of two; from 131 us to 137 s. Each edge is
    # one series per tenant per histogram: docs/latency.md, "Export precision", has the cost and the error.
    per_octave: Literal[1, 2, 4, 8, 16] = 2
    # Finer from fine_from to fine_to (widened to whole powers of two of ns), where the SLOs and the bulk of the
    # latencies live: at 2 per power of two a p99 near 70 ms read ~20 % high through histogram_quantile, at 4 ~7 %,
    # at 8 ~2 %. fine_per_octave is each tenant's (a series per edge per tenant: the cost grows with the tenants);
    # tier_fine_per_octave the per-tier histograms' and the run queue's (latency.tier_histograms: a few series).
    fine_per_octave: Literal[1, 2, 4, 8, 16] = 4
    tier_fine_per_octave: Literal[1, 2, 4, 8, 16] = 8
    fine_from: Duration = 0.010
    fine_to: Duration = 4.0

    @model_validator(mode="after")
    def _range(self) -> "ClassicBucketsConfig":
        if not 0 < self.fine_from < self.fine_to:
            raise ValueError("expected 0 < fine_from < fine_to")
        if min(self.fine_per_octave, self.tier_fine_per_octave) < self.per_octave:
            raise ValueError("expected fine_per_octave and tier_fine_per_octave >= per_octave")
        return self


class LatencyConfig(Section):
    enabled: Annotated[bool, RESTART] = True
    # Which kernel hooks time requests (docs/latency.md, "Modes"). auto: sockops where the kernel has the per-socket
    # sendmsg callback (>= 6.15) and a cgroup v2 hierarchy, else tracepoint, else kprobe. sockops costs nothing on
    # sockets that are not served on watched ports; tracepoint also tells pipelined HTTP/1.1 requests apart.
    mode: Annotated[Literal["auto", "sockops", "tracepoint", "kprobe"], RESTART] = "auto"
    # vLLM and Triton HTTP serve on 8000 (Triton gRPC on 8001), TGI on 8080 in its container and 3000 by default
    # when launched by hand. Sockets on these ports are measured even when no tenant claims them ("unmatched").
    ports: list[Port] = Field(default_factory=lambda: [8000, 8001, 8080, 3000])
    # Ports whose protocol runs several requests at once on one connection (HTTP/2, gRPC: Triton's 8001). Socket
    # events carry no payload, so such requests cannot be told apart: these connections are counted, not timed.
    multiplexed_ports: list[Port] = Field(default_factory=lambda: [8001])
    window: Duration = 10.0
    # Where the start-time self-test cannot run (no CAP_SYS_ADMIN, as under the shipped unit and DaemonSet), the hooks
    # are verified by the first connections clients open on the tracked ports; when connections keep coming for this
    # long and the programs count none, latency is degraded with the reason (docs/latency.md, "Self-test at start").
    verify_within: duration_between(1.0, 3600.0, "1s and 1h") = 60.0  # type: ignore[valid-type]
    # Server-side connections tracked at once in tracepoint and kprobe modes: slots of the kernel's socket table (a
    # power of two; sockops mode keeps state on the socket itself and needs no table). A connection
    # whose bucket of four slots is full is counted as untracked: ~0.3 % of them at a sixth of the slots in use.
    socket_slots: Annotated[int, RESTART] = 65536
    runqueue: RunqueueConfig = RunqueueConfig()
    classic_buckets: ClassicBucketsConfig = ClassicBucketsConfig()
    # Each signal's histogram summed over the tenants of each tier, with the finer classic edges: dashboards read
    # quantiles per tier from a few series, whatever the number of tenants.
    tier_histograms: bool = True

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
