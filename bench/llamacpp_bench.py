"""The agent against a real engine: llama.cpp's llama-server on CPU with the tiny model (testkit/llamacpp.py), in a
network namespace of its own, the agent inside it with latency, quota, servers and admission (enforce). Run as root
from the checkout, after make setup-test built the engine:
`python bench/llamacpp_bench.py [--seconds S]`. Prints a Markdown section for docs/PERFORMANCE.md.

1. Gold's time to first token under bronze's flood (16 connections of long prompts against 2 slots), P95 over the
   flood's last 15 s, without the agent and then with it enforcing: same engine, same run, the ratio.
2. Between them, a steady stream of gold requests (2 connections, 32 tokens each) with the agent running: its CPU
   (utime + stime of its process) per token the engine generated (the engine's own counter) and against the
   engine's CPU, and the BPF run time of the latency probes (bpf_stats, on for this phase only) per streamed request,
   the run-queue probes apart (they run at every context switch of the host, so other work there counts too).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from testkit import llamacpp  # noqa: E402
from testkit.agent import AgentProcess, agent_env  # noqa: E402

GOLD, BRONZE = "127.0.0.2", "127.0.0.3"
SLOTS = 2
# Bronze's floor (0.5/s) is a fraction of what the engine serves of its prompts (2 slots, 0.3-0.9 s each), so that
# the queue its flood left drains under it.
GOLD_PROMPT, BRONZE_PROMPT, STEADY_PROMPT = (8, 8), (400, 16), (8, 32)
BRONZE_CONNECTIONS = 16
SETTLE_S = 20.0  # gold's P95 is taken after this much of the flood: the cuts and the queue's drain come first
AGENT_CONF = """\
interval: 100ms
metrics: {{listen: "127.0.0.1:{mport}"}}
status: {{socket: {tmp}/status.sock}}
state_dir: {tmp}/state
bpf: {{pin_root: /sys/fs/bpf/qosagent-bench-{tag}}}
gpu: {{backend: none}}
tiers:
  gold:   {{slo_p99: 1000ms, weight: 10, floor: {{rps: 50, burst: 50}}}}
  bronze: {{slo_p99: 5s, weight: 1, quota: {{rps: 400, burst: 40}}, floor: {{rps: 0.5}}}}
tenants:
  - {{name: gold-app, tier: gold, match: {{cidrs: [{gold}/32], ports: [{port}]}}}}
  - {{name: bronze-app, tier: bronze, match: {{cidrs: [{bronze}/32], ports: [{port}]}}}}
latency: {{enabled: true, ports: [{port}], window: 1s}}
quota: {{enabled: true, interfaces: [lo], heartbeat_timeout: 2s}}
admission:
  enabled: true
  mode: enforce
  cooldown: 60s
  min_rps: 0.25
  server_pressure: {{kv_enter: 1.0, kv_exit: 0.9, queue_enter: 4, queue_exit: 1, queue_ticks: 3, cut_every: 1s}}
servers: [{{port: {port}, kind: llamacpp}}]
"""


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * 0.95))] if s else float("nan")


class Clients:
    """testkit.load processes inside the namespace, each writing its requests' [start, latency ms, ok]."""

    def __init__(self, ns: str, tmp: Path, port: int):
        self.ns, self.tmp, self.port, self.n = ns, tmp, port, 0

    def start(self, src: str, threads: int, pause_ms: float, seconds: float,
              prompt: tuple[int, int]) -> tuple[subprocess.Popen[bytes], Path]:
        self.n += 1
        out = self.tmp / f"load-{self.n}.json"
        argv = ["ip", "netns", "exec", self.ns, sys.executable, "-m", "testkit.load", "chat", "127.0.0.1",
                str(self.port), src, str(threads), str(pause_ms), str(seconds), "60", str(out), *map(str, prompt)]
        return subprocess.Popen(argv, env=agent_env(), cwd=REPO), out

    @staticmethod
    def results(p: tuple[subprocess.Popen[bytes], Path]) -> list[tuple[float, float, bool]]:
        assert p[0].wait(180) == 0
        return [tuple(r) for r in json.loads(p[1].read_text())]  # type: ignore[misc]


def overload(clients: Clients, seconds: float) -> tuple[float, int]:
    """Gold's TTFT P95 (ms) over requests that started after SETTLE_S of bronze's flood, and how many."""
    t0 = time.monotonic()
    flood = clients.start(BRONZE, BRONZE_CONNECTIONS, 0, seconds, BRONZE_PROMPT)
    gold = clients.start(GOLD, 2, 200, seconds, GOLD_PROMPT)
    got = [ms for t, ms, ok in clients.results(gold) if ok and t > t0 + SETTLE_S]
    clients.results(flood)
    return p95(got), len(got)


def drained(srv: llamacpp.LlamaServer, timeout: float = 120.0) -> None:
    """Until the engine holds no request (the flood's queue is served before the next phase)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = srv.metrics()
        if m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the engine did not drain")


def prog_run(ids: list[int]) -> dict[str, tuple[int, int]]:
    """Summed run_time_ns and run_cnt of these programs: the run-queue probes (sched tracepoints, which run at every
    context switch of the host) apart from those on the requests' path."""
    out = {"requests": (0, 0), "runqueue": (0, 0)}
    for i in ids:
        info = json.loads(subprocess.run(["bpftool", "prog", "show", "id", str(i), "--json"], capture_output=True,
                                         text=True, check=True).stdout)
        part = "runqueue" if info.get("name", "").startswith("tracepoint__sch") else "requests"
        ns, cnt = out[part]
        out[part] = ns + info.get("run_time_ns", 0), cnt + info.get("run_cnt", 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=35.0, help="each flood's length (> 20)")
    ap.add_argument("--steady", type=float, default=20.0, help="the steady phase's length")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("llamacpp_bench: run as root (BPF, TC, a network namespace)")
    where = llamacpp.engine()
    if where is None:
        sys.exit(f"llamacpp_bench: {llamacpp.NOT_BUILT}")
    ns = f"qa-llamabench-{secrets.token_hex(3)}"
    tmp = Path(tempfile.mkdtemp(prefix="qosagent-llamabench-"))
    port = 20000 + secrets.randbelow(20000)
    sh("ip", "netns", "add", ns)
    srv = agent = None
    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats_path.read_text().strip()
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        srv = llamacpp.LlamaServer(where, llamacpp.model(where, tmp), port, tmp / "engine.log", slots=SLOTS,
                                   prefix=["ip", "netns", "exec", ns]).start()
        clients = Clients(ns, tmp, port)
        without, n_without = overload(clients, args.seconds)
        drained(srv)

        cfg = tmp / "qosagent.yaml"
        cfg.write_text(AGENT_CONF.format(mport=port + 1, tmp=tmp, tag=secrets.token_hex(4), gold=GOLD, bronze=BRONZE,
                                         port=port))
        agent = AgentProcess(cfg, str(tmp / "status.sock"), tmp / "agent.log", prefix=["ip", "netns", "exec", ns],
                             args=["--detach-on-exit"])
        agent.start()
        assert agent.proc is not None and srv.proc is not None
        lat = agent.status()["latency"]
        ids, mode = [p["id"] for p in lat["programs"]], lat["mode"]
        time.sleep(2.0)
        stats_path.write_text("1")
        tok0, a0, e0, b0 = srv.metrics()["llamacpp:tokens_predicted_total"], cpu_s(agent.proc.pid), \
            cpu_s(srv.proc.pid), prog_run(ids)
        steady = clients.results(clients.start(GOLD, 2, 0, args.steady, STEADY_PROMPT))
        tok1, a1, e1, b1 = srv.metrics()["llamacpp:tokens_predicted_total"], cpu_s(agent.proc.pid), \
            cpu_s(srv.proc.pid), prog_run(ids)
        stats_path.write_text(stats_before)
        served = sum(ok for _, _, ok in steady)

        with_agent, n_with = overload(clients, args.seconds)
        tokens = tok1 - tok0
        print("## llama.cpp's llama-server (CPU, tiny model): the agent against a real engine\n")
        print(f"Measured by `python bench/llamacpp_bench.py --seconds {args.seconds:g} --steady {args.steady:g}` "
              f"({os.cpu_count()} CPUs).\n")
        print("| measure | value |\n|---|---|")
        print(f"| steady phase | {served} streamed requests, {tokens:.0f} tokens generated in {args.steady:g} s |")
        print(f"| agent CPU per generated token | {(a1 - a0) / tokens * 1e6:.0f} µs |")
        print(f"| agent CPU / engine CPU | {(a1 - a0) / (e1 - e0):.3f} ({a1 - a0:.2f} s / {e1 - e0:.2f} s) |")
        for part, what in (("requests", f"latency probes' BPF time ({mode} mode) per streamed request"),
                           ("runqueue", "run-queue probes' BPF time, over the same requests")):
            ns, runs = b1[part][0] - b0[part][0], b1[part][1] - b0[part][1]
            print(f"| {what} | {ns / served / 1e3:.1f} µs ({runs / served:.0f} runs each) |")
        print(f"| gold TTFT P95 under bronze's flood, without the agent | {without:.0f} ms ({n_without} requests) |")
        print(f"| the same with the agent enforcing | {with_agent:.0f} ms ({n_with} requests) |")
        print(f"| with ÷ without | {with_agent / without:.3f} |")
    finally:
        stats_path.write_text(stats_before)
        if agent is not None:
            agent.stop()
        if srv is not None:
            srv.stop()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    main()
