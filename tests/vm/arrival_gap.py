"""Where the time between a client's TTFB and the agent's time to headers goes, per request, on this kernel.

    python -m tests.vm.arrival_gap [--requests N]

The kernel matrix's latency test (tests/integration/test_latency_agent.py) compares the agent's time to headers
with what its Python client measured. Under emulation the two differed by several ms in kprobe mode. This splits a
client's TTFB into its parts with kprobes of its own, on the client's and the server's sockets (told apart by the
socket each one's tcp_sendmsg names), all on CLOCK_MONOTONIC:

    client call -> client send (tcp_sendmsg): the client's own code before its bytes leave
    client send -> server arrival (sock_def_readable on the server socket): loopback transit
    server arrival -> server first read (tcp_cleanup_rbuf): what an arrival clock adds over a read clock
    server arrival -> server response send (tcp_sendmsg): what the agent's arrival clock times
    server send -> client arrival (sock_def_readable on the client socket): loopback transit back
    client arrival -> client has headers: the client's wakeup and header parsing

Prints one JSON line: the median of each part over N requests (half on fresh connections, half on one keep-alive
connection, as the test does), in ms, and the client's p50/p95/p99 TTFB over all of them; with --agent MODE, beside
them the p50/p95/p99 time to headers that an agent it starts (latency.mode MODE, the test's config) reported for the
same requests.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from qosagent.status import request

from tests.integration.latency_helpers import serving
from tests.integration.test_latency_agent import EXAMPLE, FAST_DELAY, AgentProc, Handler, exact_quantile

PORT = 18001  # the test's fast server: FAST_DELAY (20 ms, 80 ms under emulation), then headers and a 3-byte body
PROG = r"""
#include <uapi/linux/ptrace.h>
struct ev { u64 ts; u64 sk; u32 tid; u32 kind; };
BPF_PERF_OUTPUT(events);
static __always_inline void emit(struct pt_regs *ctx, u32 kind)
{
    struct ev e = {.ts = bpf_ktime_get_ns(), .sk = PT_REGS_PARM1(ctx), .tid = (u32)bpf_get_current_pid_tgid(),
                   .kind = kind};
    events.perf_submit(ctx, &e, sizeof(e));
}
int on_send(struct pt_regs *ctx) { emit(ctx, 0); return 0; }
int on_readable(struct pt_regs *ctx) { emit(ctx, 1); return 0; }
int on_read(struct pt_regs *ctx) { emit(ctx, 2); return 0; }
"""
SEND, READABLE, READ = 0, 1, 2


class Ev(ctypes.Structure):
    _fields_ = [("ts", ctypes.c_uint64), ("sk", ctypes.c_uint64), ("tid", ctypes.c_uint32), ("kind", ctypes.c_uint32)]


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(prog="python -m tests.vm.arrival_gap")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--agent", metavar="MODE", help="run the agent in this latency mode meanwhile")
    a = p.parse_args(argv)
    with ExitStack() as stack:
        agent = None
        if a.agent:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            agent = AgentProc(tmp, EXAMPLE + f"latency:\n  mode: {a.agent}\n")
            stack.callback(agent.kill)  # after stop(), or in place of it when the run fails first
            agent.start(timeout=600)
            stack.callback(agent.stop)
        out = measure(a.requests)
        if agent is not None:
            time.sleep(1)  # a tick or more: the agent's histograms as of the last request
            st = request(agent.socket, {"cmd": "status"}, timeout=60)
            row = next(t for t in st["latency"]["tenants"] if t["tenant"] == "acme")
            quantiles = {f"headers_{q}_ms": round(row["headers_total"][q] * 1e3, 3) for q in ("p50", "p95", "p99")}
            out["agent"] = {"mode": a.agent, "requests": row["requests"], **quantiles}
    print("arrival_gap " + json.dumps(out), flush=True)
    return 0


def measure(requests: int) -> dict[str, object]:
    from bcc import BPF

    b = BPF(text=PROG)
    b.attach_kprobe(event=b"tcp_sendmsg", fn_name=b"on_send")
    b.attach_kprobe(event=b"sock_def_readable", fn_name=b"on_readable")
    b.attach_kprobe(event=b"tcp_cleanup_rbuf", fn_name=b"on_read")
    events: list[Ev] = []
    b[b"events"].open_perf_buffer(lambda _c, data, _s: events.append(Ev.from_buffer_copy(
        ctypes.string_at(data, ctypes.sizeof(Ev)))), page_cnt=256)
    me = threading.get_native_id()
    windows: list[tuple[int, int]] = []
    with serving((PORT,), Handler):
        keep = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
        for i in range(requests):
            conn = keep if i % 2 else http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
            conn.connect() if conn.sock is None else None
            t0 = time.monotonic_ns()
            conn.request("GET", "/")
            resp = conn.getresponse()
            t1 = time.monotonic_ns()
            resp.read()
            windows.append((t0, t1))
            if conn is not keep:
                conn.close()
            b.perf_buffer_poll(timeout=0)
        keep.close()
    b.perf_buffer_poll(timeout=100)
    b.cleanup()
    parts: dict[str, list[float]] = {k: [] for k in ("client_ttfb", "client_before_send", "transit_in",
                                                     "arrival_to_read", "agent_headers_arrival_clock",
                                                     "agent_headers_read_clock", "transit_out", "client_after_arrival")}
    for t0, t1 in windows:
        w = [e for e in events if t0 <= e.ts <= t1]
        c_send = next((e for e in w if e.kind == SEND and e.tid == me), None)
        s_send = next((e for e in w if e.kind == SEND and e.tid != me), None)
        if c_send is None or s_send is None:
            continue
        s_arr = next((e for e in w if e.kind == READABLE and e.sk == s_send.sk), None)
        s_read = next((e for e in w if e.kind == READ and e.sk == s_send.sk and e.tid != me), None)
        c_arr = next((e for e in w if e.kind == READABLE and e.sk == c_send.sk and e.ts >= s_send.ts), None)
        if s_arr is None or s_read is None or c_arr is None:
            continue
        ms = 1e-6
        parts["client_ttfb"].append((t1 - t0) * ms)
        parts["client_before_send"].append((c_send.ts - t0) * ms)
        parts["transit_in"].append((s_arr.ts - c_send.ts) * ms)
        parts["arrival_to_read"].append((s_read.ts - s_arr.ts) * ms)
        parts["agent_headers_arrival_clock"].append((s_send.ts - s_arr.ts) * ms)
        parts["agent_headers_read_clock"].append((s_send.ts - s_read.ts) * ms)
        parts["transit_out"].append((c_arr.ts - s_send.ts) * ms)
        parts["client_after_arrival"].append((t1 - c_arr.ts) * ms)
    # The quantiles the test compares, over every request (the parts above only over those whose events matched).
    ttfb_ms = [(t1 - t0) * 1e-6 for t0, t1 in windows]
    return {"requests": requests, "matched": len(parts["client_ttfb"]), "server_delay_ms": FAST_DELAY * 1e3,
            "p50_ms": {k: round(statistics.median(v), 3) for k, v in parts.items() if v},
            "client_ttfb_ms": {f"p{round(q * 100)}": round(exact_quantile(ttfb_ms, q), 3) for q in (0.5, 0.95, 0.99)}}


if __name__ == "__main__":
    sys.exit(main())
