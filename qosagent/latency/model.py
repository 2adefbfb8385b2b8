"""The latency capability's part of the Snapshot: what admission, metrics and status read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from qosagent.hist import Histogram


@dataclass(frozen=True)
class TenantLatency:
    tenant: str
    tier: str
    requests: int  # requests completed since start
    ttfb: Histogram  # time to first response byte, since start
    response: Histogram  # time to the last response byte, since start
    ttfb_window: Histogram  # the same over the last latency.window
    response_window: Histogram
    rate_rps: float  # completed requests per second over the window
    in_flight: int = 0  # requests received and not yet answered
    unpaired: int = 0  # responses without a request, requests closed without a response
    overlapped: int = 0  # requests that arrived while one was in progress (pipelining, HTTP/2): not timed
    unpaired_send: int = 0  # of unpaired: write bursts with no request read before them
    unpaired_close: int = 0  # of unpaired: requests closed without a response byte
    extra_reads: int = 0  # reads of request bytes after the first and before the response (pieces, pipelining)
    connections: int = 0  # server-side connections tracked since start
    multiplexed_connections: int = 0  # of those, on latency.multiplexed_ports: counted, their requests not timed
    lost: int = 0  # observations the kernel dropped because its histogram map was full
    untracked: int = 0  # connections not tracked because the kernel's socket table had no free slot


@dataclass(frozen=True)
class LatencyPart:
    window_s: float
    tenants: Mapping[str, TenantLatency] = field(default_factory=dict)
    runqueue: Histogram | None = None  # run-queue latency of watched processes, since start
    runqueue_window: Histogram | None = None
