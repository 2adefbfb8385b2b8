"""What the latency probes cost: nginx + wrk on loopback with and without the agent, per-event BPF cost, agent CPU,
RSS and start-to-ready time. Run as root: `python -m bench.latency_overhead [--pairs N] [--seconds S]`.

Throughput is compared in interleaved pairs (without, with) inside one run and summarised by the median ratio, so
the noise of a shared machine hits both sides alike. Prints a markdown block for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  server {{
    listen 127.0.0.1:{port};
    location / {{ return 200 "ok\\n"; }}
  }}
}}
"""
AGENT_CONF = """\
interval: 100ms
metrics:
  listen: 127.0.0.1:{mport}
status:
  socket: {tmp}/status.sock
tenants:
  - name: bench
    tier: gold
    match: {{ports: [{watched}]}}
latency:
  ports: [{watched}]
  runqueue: {{enabled: {runq}}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wrk(port: int, seconds: int, threads: int, conns: int) -> float:
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", f"http://127.0.0.1:{port}/"],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m:
        raise RuntimeError(f"no Requests/sec in wrk output:\n{out}")
    return float(m.group(1))


class Agent:
    def __init__(self, tmp: Path, watched: int, runq: bool):
        self.tmp = tmp
        self.mport = free_port()
        cfg = tmp / "agent.yaml"
        cfg.write_text(AGENT_CONF.format(mport=self.mport, tmp=tmp, watched=watched, runq=str(runq).lower()))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "qosagent", "run", "--config", str(cfg)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=(tmp / "agent.log").open("a"))
        self.ready_s = self._wait_ready()

    def _wait_ready(self) -> float:
        while time.monotonic() - self.t0 < 60:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {(self.tmp / 'agent.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.mport}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("agent not ready in 60s")

    def status(self) -> dict:
        out = subprocess.run([sys.executable, "-m", "qosagent", "status", "--json", "--socket",
                              str(self.tmp / "status.sock")], capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO))).stdout
        return json.loads(out)

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def prog_stats(ids: list[int]) -> dict[int, tuple[str, int, int]]:
    out = {}
    for i in ids:
        info = json.loads(subprocess.run(["bpftool", "prog", "show", "id", str(i), "--json"], capture_output=True,
                                         text=True, check=True).stdout)
        out[i] = (info.get("name", "?"), info.get("run_time_ns", 0), info.get("run_cnt", 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--no-runqueue", action="store_true", help="measure with latency.runqueue.enabled: false")
    ap.add_argument("--unwatched", action="store_true",
                    help="watch another port than nginx's: every probe event a miss (the noise floor of the bench)")
    args = ap.parse_args()
    for tool in ("nginx", "wrk", "bpftool"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed (make setup-test installs it)")
    tmp = Path(tempfile.mkdtemp(prefix="qosagent-bench-"))
    port = free_port()
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, port=port))
    nginx = subprocess.Popen(["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)])
    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats_path.read_text().strip()
    try:
        time.sleep(0.5)
        wrk(port, 1, args.threads, args.connections)  # warm up nginx and the page cache
        ratios, base_rps, with_rps, ready, idle_cpu, load_cpu, rss_idle, rss_load = [], [], [], [], [], [], [], []
        per_event: dict[str, list[float]] = {}
        probe_ns_per_req: list[float] = []
        cpu_ns_per_req: list[float] = []
        for pair in range(args.pairs):
            # Alternate which side runs first, so a drift in the machine's load does not favour one side.
            if pair % 2 == 0:
                without = wrk(port, args.seconds, args.threads, args.connections)
            agent = Agent(tmp, free_port() if args.unwatched else port, runq=not args.no_runqueue)
            try:
                ready.append(agent.ready_s)
                time.sleep(1.0)  # past the first ticks
                c0, t0 = agent.cpu_s(), time.monotonic()
                time.sleep(2.0)
                idle_cpu.append((agent.cpu_s() - c0) / (time.monotonic() - t0))
                rss_idle.append(agent.rss_mb())
                c0, t0 = agent.cpu_s(), time.monotonic()
                with_ = wrk(port, args.seconds, args.threads, args.connections)
                load_cpu.append((agent.cpu_s() - c0) / (time.monotonic() - t0))
                rss_load.append(agent.rss_mb())
                # Per-event cost in a run of its own: bpf_stats timing slows every BPF program it measures.
                ids = [p["id"] for p in agent.status()["latency"]["programs"]]
                stats_path.write_text("1")
                s0 = prog_stats(ids)
                stats_rps = wrk(port, 2, args.threads, args.connections)
                s1 = prog_stats(ids)
                stats_path.write_text(stats_before)
                total_ns = 0
                for i, (name, ns, cnt) in s1.items():
                    d_ns, d_cnt = ns - s0[i][1], cnt - s0[i][2]
                    total_ns += d_ns
                    if d_cnt:
                        per_event.setdefault(name, []).append(d_ns / d_cnt)
                # Noise-free view of the same cost: BPF time per request against the CPU time a request gets.
                requests = stats_rps * 2
                probe_ns_per_req.append(total_ns / requests)
                cpu_ns_per_req.append(os.cpu_count() * 2 * 1e9 / requests)
            finally:
                agent.stop()
            if pair % 2 == 1:
                without = wrk(port, args.seconds, args.threads, args.connections)
            base_rps.append(without)
            with_rps.append(with_)
            ratios.append(with_ / without)
    finally:
        stats_path.write_text(stats_before)
        nginx.terminate()
        nginx.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)

    med = statistics.median(ratios)
    print(f"### Latency probes ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs shared, kernel "
          f"{os.uname().release})\n")
    print(f"nginx (1 worker, `return 200`) on loopback, wrk -t{args.threads} -c{args.connections} -d{args.seconds}s, "
          f"{args.pairs} interleaved pairs (order alternating), run-queue probes "
          f"{'off' if args.no_runqueue else 'on'}{', nginx port not watched' if args.unwatched else ''}.\n")
    print("| pair | without (req/s) | with (req/s) | ratio |\n|---|---|---|---|")
    for i, (a, b, r) in enumerate(zip(base_rps, with_rps, ratios), 1):
        print(f"| {i} | {a:,.0f} | {b:,.0f} | {r:.3f} |")
    print(f"\n**Median ratio {med:.3f}** ({(1 - med) * 100:+.1f} % fewer req/s; target <= 3 %).\n")
    pr, cr = statistics.median(probe_ns_per_req), statistics.median(cpu_ns_per_req)
    print(f"BPF run time per request: **{pr:,.0f} ns** of ~{cr:,.0f} ns CPU per request "
          f"({os.cpu_count()} CPUs x run / requests): **{pr / cr * 100:.1f} %** of the machine's CPU time.\n")
    print("| program | ns per event (median over pairs) |\n|---|---|")
    for name, vals in sorted(per_event.items()):
        print(f"| {name} | {statistics.median(vals):.0f} |")
    print("\n| agent | median | max | target |\n|---|---|---|---|")
    print(f"| CPU idle (% of one core) | {statistics.median(idle_cpu) * 100:.2f} | {max(idle_cpu) * 100:.2f} | <= 2 |")
    print(f"| CPU under load (% of one core) | {statistics.median(load_cpu) * 100:.2f} "
          f"| {max(load_cpu) * 100:.2f} | - |")
    print(f"| RSS idle (MB) | {statistics.median(rss_idle):.0f} | {max(rss_idle):.0f} | <= 150 |")
    print(f"| RSS under load (MB) | {statistics.median(rss_load):.0f} | {max(rss_load):.0f} | <= 150 |")
    print(f"| start to ready (s) | {statistics.median(ready):.2f} | {max(ready):.2f} | <= 3 |")


if __name__ == "__main__":
    main()
