"""What the agent costs per streamed request: a FastAPI/uvicorn server streaming SSE chat completions (vLLM's way),
an httpx client at concurrency 4 on kept-alive connections, and a real `qosagent run` watching the port.

Reports the agent process's CPU per streamed request (its tick reads the maps; the kernel side runs in the server's
and the client's context, not the agent's) and the BPF run time per streamed request and per program, from
`kernel.bpf_stats_enabled=1` (restored afterwards). Run as root: `python -m bench.sse_cost [--requests N]`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.latency_overhead import Agent, free_port, prog_stats
from testkit.sse_client import httpx_requests
from testkit.sse_server import sse_server

STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--mode", default="auto", choices=("auto", "sockops", "tracepoint"))
    args = ap.parse_args()
    port = free_port()
    body = {"stream": True, "prefill_ms": 20.0, "token_ms": 5.0, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as d, sse_server("uvicorn", port=port):
        agent = Agent(Path(d), port, True, args.mode)
        try:
            # The server listened before the agent: one request while the start-up learner runs finds its cgroup (as
            # a real server's first request would); then past the learner (latency.capability.LEARN_S), the steady
            # state.
            httpx_requests(f"http://127.0.0.1:{port}", [body], concurrency=1)
            time.sleep(31)
            mode = agent.status()["latency"]["mode"]
            ids = [p["id"] for p in agent.status()["latency"]["programs"]]
            before_stats = STATS.read_text()
            STATS.write_text("1")
            try:
                s0, cpu0, t0 = prog_stats(ids), agent.cpu_s(), time.monotonic()
                timings = httpx_requests(f"http://127.0.0.1:{port}", [body] * args.requests, concurrency=4)
                wall, cpu1, s1 = time.monotonic() - t0, agent.cpu_s(), prog_stats(ids)
            finally:
                STATS.write_text(before_stats)
            time.sleep(0.5)  # a few ticks: the last responses are in the snapshot status reads
            got = agent.status()["latency"]["tenants"]
        finally:
            agent.stop()
    n = len(timings)
    writes = sum(len(t.chunks) for t in timings)
    print(f"### Streamed requests ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, latency.mode {mode})\n")
    print(f"{n} SSE streams of {args.tokens} tokens (+ [DONE]), httpx at concurrency 4, {wall:.1f} s; the agent "
          f"counted {sum(t['requests'] for t in got) - 1} of them.\n")
    print(f"Agent process CPU: {(cpu1 - cpu0) / n * 1e6:,.0f} µs per streamed request "
          f"({(cpu1 - cpu0) / wall * 100:.2f} % of one core over the run).\n")
    print("| program | ns per event | events per streamed request | ns per streamed request |\n|---|---|---|---|")
    total = 0.0
    for i, (name, ns, cnt) in sorted(s1.items(), key=lambda kv: kv[1][0]):
        d_ns, d_cnt = ns - s0[i][1], cnt - s0[i][2]
        if d_cnt:
            total += d_ns / n
            print(f"| {name} | {d_ns / d_cnt:,.0f} | {d_cnt / n:.2f} | {d_ns / n:,.0f} |")
    print(f"\nBPF run time: **{total:,.0f} ns per streamed request**, {total / max(writes / n, 1):,.0f} ns per body "
          f"read the client saw ({writes / n:.1f} per request).")


if __name__ == "__main__":
    main()
