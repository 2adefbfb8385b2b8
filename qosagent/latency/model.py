"""The latency capability's part of the Snapshot: what admission, metrics and status read."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from qosagent.hist import Histogram
from qosagent.slo import SloVerdict
from qosagent.snapshot import PartKey

# The run-queue row of the processes serving several tiers, as the `tier` label and status name it: never one tier's,
# and never a tier's name (those begin with a letter or a digit, qosagent.config.Name).
SHARED_TIER = "_shared"


@dataclass(frozen=True)
class Plan:
    """What probing chose for this kernel, which start() compiles and attaches."""

    mode: str  # "sockops", "tracepoint" or "kprobe"
    arrival: bool  # request clocks start at arrival (sock:sk_data_ready, a kprobe, the ingress program)
    egress: bool  # responses are read as they leave (TTFT, inter-token): a cgroup_skb egress program
    runq: bool  # run-queue latency: the sched tracepoints


@dataclass(frozen=True)
class TenantLatency:
    tenant: str
    tier: str
    requests: int  # requests completed since start
    headers: Histogram  # time to the first response bytes (the headers, for HTTP), since start
    ttft: Histogram  # time to the first response body byte (first token), since start
    response: Histogram  # time to the last response byte, since start
    inter_token: Histogram  # gaps between a response's successive body writes, since start
    headers_window: Histogram  # the same over the last latency.window
    ttft_window: Histogram
    response_window: Histogram
    inter_token_window: Histogram
    rate_rps: float  # completed requests per second over the window
    in_flight: int = 0  # requests received and not yet complete
    unpaired: int = 0  # responses without a request, requests closed without a response
    overlapped: int = 0  # requests that arrived while one was in progress (pipelining, HTTP/2): not timed
    unpaired_send: int = 0  # of unpaired: write bursts with no request read before them
    unpaired_close: int = 0  # of unpaired: requests closed without a response byte
    pipelined: int = 0  # next request lines that arrived while a request still waited (sockops mode)
    connections: int = 0  # server-side connections tracked since start
    multiplexed_connections: int = 0  # of those, on latency.multiplexed_ports: counted, their requests not timed
    lost: int = 0  # observations the kernel dropped because its histogram map was full
    untracked: int = 0  # connections not tracked because the kernel's socket table had no free slot
    no_ttft: Mapping[str, int] = field(default_factory=dict)  # responses without a TTFT, by reason, since start
    interim: int = 0  # interim (1xx) responses passed over
    framed: int = 0  # responses ended at their last byte by their framing (Content-Length, chunked, 204/304)
    adopted: int = 0  # of connections, those open before their port was watched, observed from their next request

    def window(self, signal: str) -> Histogram:
        """The window histogram of a latency signal (admission.signal, alert rules): ttft, headers or response."""
        return {"ttft": self.ttft_window, "headers": self.headers_window, "response": self.response_window}[signal]


@dataclass(frozen=True)
class Hooks:
    """The programs and their hooks as the tick found them: what metrics and status report beside the counts."""

    mode: str = ""  # "sockops", "tracepoint" or "kprobe"
    attached: int = 0  # programs attached to their hooks
    programs: tuple[tuple[str, int], ...] = ()  # loaded programs: name, kernel id (`bpftool prog show id N`)
    ttft: str = ""  # "measured: ...", or "unavailable: <why>"
    cgroups: tuple[str, ...] = ()  # sockops mode: the cgroups whose request arrivals are hooked
    learning: bool = False  # sockops mode: the learners are still linked on the cgroup2 root
    cgroup_errors: int = 0  # sockops mode: serving cgroups not linked, failed polls of the kernel's reports
    # sockops mode: packets lat_egress_learn could not tail-call lat_egress for (its slot empty or wrong), each
    # possibly a response whose TTFT was lost; never expected (bpf/latency_sockops.c)
    egress_unread: int = 0


@dataclass(frozen=True)
class LatencyPart:
    window_s: float
    tenants: Mapping[str, TenantLatency] = field(default_factory=dict)
    runqueue: Histogram | None = None  # run-queue latency of every serving process's threads, since start
    runqueue_window: Histogram | None = None
    # The same by the tier the process serves (SHARED_TIER: several), those with waits only; they sum to the above.
    runqueue_tiers: Mapping[str, Histogram] = field(default_factory=dict)
    runqueue_tiers_window: Mapping[str, Histogram] = field(default_factory=dict)
    # Connections found open on a port when it became watched (at start or a reload), since start, and the watched-port
    # connections not observed now, by reason (qosagent/latency/adopt.py REASONS).
    found_open: int = 0
    unobserved: Mapping[str, int] = field(default_factory=dict)
    hooks: Hooks = Hooks()
    slo: Mapping[str, float] = field(default_factory=dict)  # tenants[].tier's slo_p99 of the configured tenants
    # Serving network namespaces whose addresses attribute process and pods tenants (qosagent/latency/pods.py), as
    # status shows them.
    namespaces: tuple[Mapping[str, Any], ...] = ()
    # This tick's SLO verdict, judged once in collect (qosagent/slo.py); None in a part built without one.
    verdict: SloVerdict | None = None
    # Slots whose rows this tick read: those whose generation moved (bpf/include/lat_state.h, lat_gen), so 0 on a
    # tick without traffic, however many tenants are configured.
    rows_read: int = 0

    def judged(self, signal: str, quantile: float, tier_slo: Mapping[str, float] = MappingProxyType({}),
               near_slo: float = 0.8, healthy_below: float = 0.9) -> SloVerdict:
        """The verdict collect judged; judged here only for a part built without one (or, after a reload, read
        under a signal it was not collected for), by the same rule."""
        v = self.verdict
        if v is not None and (v.signal, v.quantile) == (signal, quantile):
            return v
        return SloVerdict({n: (t.tier, t.window(signal)) for n, t in self.tenants.items()}, self.slo, tier_slo, signal,
                     quantile, near_slo, healthy_below)


LATENCY = PartKey("latency", LatencyPart)
