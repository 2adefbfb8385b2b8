"""What the latency probes cost: nginx + wrk on loopback with and without the probes, per-event BPF cost, agent CPU,
RSS and start-to-ready time. Run as root: `python -m bench.latency_overhead [--pairs N] [--window S]`.

Throughput: one long wrk run against nginx while an in-process agent (the daemon's own Agent, ticking every
`interval` in a thread) has its probes attached and detached in alternating windows; nginx's stub_status request
counter gives each window's rate, and each (without, with) pair of neighbouring windows gives a ratio, summarised by
the median. Windows of a fraction of a second inside one run keep the drift of a shared VM (seconds-long swings of
10-30 % in wrk's own rate) out of the pairs, which separate wrk runs with an agent started and stopped between them
could not. Detached, the agent does nothing: no probes fire and no tick runs, as without an agent.
Start-to-ready, CPU and RSS come from the real `qosagent run` process. Prints a markdown block for
docs/PERFORMANCE.md.
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
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from testkit.agent import AgentProcess  # noqa: E402
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
  server {{
    listen 127.0.0.1:{status_port};
    location / {{ stub_status; }}
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
  mode: {mode}
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


class Agent(AgentProcess):
    """The agent in its own process, as deployed: its CPU time and memory are read from /proc."""

    def __init__(self, tmp: Path, watched: int, runq: bool, mode: str):
        self.tmp = tmp
        self.mport = free_port()
        cfg = tmp / "agent.yaml"
        cfg.write_text(AGENT_CONF.format(mport=self.mport, tmp=tmp, watched=watched, runq=str(runq).lower(), mode=mode))
        super().__init__(cfg, str(tmp / "status.sock"), tmp / "agent.log")
        self.launch()
        self.wait_ready(poll=0.02)

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


def prog_stats(ids: list[int]) -> dict[int, tuple[str, int, int]]:
    out = {}
    for i in ids:
        info = json.loads(subprocess.run(["bpftool", "prog", "show", "id", str(i), "--json"], capture_output=True,
                                         text=True, check=True).stdout)
        out[i] = (info.get("name", "?"), info.get("run_time_ns", 0), info.get("run_cnt", 0))
    return out


def nginx_requests(status_port: int) -> int:
    """nginx's count of requests served so far (stub_status: active / accepts handled requests / reading...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/", timeout=5) as r:
        return int(r.read().decode().splitlines()[2].split()[2])


class Toggled:
    """The daemon's Agent in this process, with its latency probes attached or detached at will and its tick loop
    running only while attached."""

    def __init__(self, tmp: Path, watched: int, runq: bool, mode: str, serving_cgroup: str | None,
                 tick: bool = True, arrival: bool = True):
        sys.path.insert(0, str(REPO))
        from qosagent.config import parse
        from qosagent.daemon import Agent
        from qosagent.hostfs import HostFS

        cfg = parse(yaml_config(tmp, watched, runq, free_port(), mode), "bench")
        self.agent = Agent(cfg, HostFS("/"))
        self.agent.start()
        lat = next(c for c in self.agent.capabilities if c.name == "latency")
        if lat.mode not in ("sockops", "tracepoint"):
            raise RuntimeError(f"the bench toggles sockops links or tracepoints; the probes run in {lat.mode} mode")
        self.lat = lat
        self.prog = lat.dp.prog
        self.fs = HostFS("/")
        if lat.mode == "sockops" and serving_cgroup:
            # nginx listened before the agent started: its cgroup would be learned at its first response. Linked
            # now, so that no window starts before it is (and so that empty programs, which learn nothing, work).
            lat.hooks.watch._ingress.attach(serving_cgroup)
            lat.hooks.watch.stop_learning()  # the root-wide learner would time the first windows' arrivals twice over
        if not arrival:
            # Without the arrival hook no request is ever stamped on arrival: each is timed from its first read.
            self.prog.detach("raw_tracepoint__sk_data_ready")
        self.traced = list(self.prog.attached)
        self.ingress_paths: list[str] = []
        self.interval = cfg.interval
        self.tick = tick
        self.on = threading.Event()
        self.on.set()
        self.ticks = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.wait(self.interval):
            if self.on.is_set() and self.tick:
                self.agent.tick()
                self.ticks += 1

    def attach(self) -> None:
        self.prog.attach(self.fs, self.traced)
        if self.lat.mode == "sockops":
            # The capability's own links, closed and made again: what an agent start and stop do to the hooks.
            # The sockets keep the callbacks they were given, so with the links back they are timed again.
            from qosagent.ebpf.libbpf import ATTACH_CGROUP_SOCK_OPS
            from qosagent.latency.links import link_root

            watch = self.lat.hooks.watch
            watch._sockops_link = link_root(watch.fs, watch.root, self.prog.fd("lat_sockops"),
                                            ATTACH_CGROUP_SOCK_OPS)
            for path in self.ingress_paths:
                self.lat.hooks.watch._ingress.attach(path)
        self.lat.hooks.adopter.set_adopting()
        self.on.set()

    def detach(self) -> None:
        self.on.clear()
        self.lat.hooks.adopter.close()  # tracepoint mode's adopter, linked while a connection awaits adoption
        for name in self.traced:
            self.prog.detach(name)
        if self.lat.mode == "sockops":
            os.close(self.lat.hooks.watch._sockops_link)
            self.ingress_paths = self.lat.hooks.watch.cgroups()
            for path in self.ingress_paths:
                self.lat.hooks.watch._ingress.detach(path)

    def close(self) -> None:
        self._done.set()
        self._thread.join()
        if not self.on.is_set():
            self.attach()  # the agent's stop detaches what it attached
        self.agent.stop()


class IdleConnection:
    """A keep-alive connection to nginx opened before an agent starts and idle while it runs: the agent finds it open
    and waits for its next request to adopt it, so its adoption hooks stay on (--adopting)."""

    def __init__(self, port: int):
        self.port = port
        self.sock: socket.socket | None = None

    def refresh(self) -> None:
        """One request, so that nginx keeps the connection (keepalive_timeout) through the next agent's life."""
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        if not self.sock.recv(4096).startswith(b"HTTP/1.1 200"):
            raise RuntimeError("nginx did not answer on the idle connection")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def yaml_config(tmp: Path, watched: int, runq: bool, mport: int, mode: str) -> dict:
    import yaml

    return yaml.safe_load(AGENT_CONF.format(mport=mport, tmp=tmp, watched=watched, runq=str(runq).lower(), mode=mode))


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of whole processes (all their threads), probes' run time included: BPF programs
    run in the context of the process whose read or write fires them."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Window:
    rps: float
    cpu_per_request_s: float


def throughput_windows(port: int, status_port: int, nginx_pid: int, tmp: Path, serving_cgroup: str | None,
                       args: argparse.Namespace) -> tuple[list[tuple[Window, Window]], str]:
    """(without, with) for each pair of neighbouring windows of one wrk run: the request rate nginx saw, and the
    CPU time nginx, wrk and the agent spent per request (what other load on a shared machine does not change)."""
    t = Toggled(tmp, free_port() if args.unwatched else port, runq=not args.no_runqueue, mode=args.mode,
                serving_cgroup=serving_cgroup, tick=not args.no_tick, arrival=not args.no_arrival)
    workers = [int(p) for p in Path(f"/proc/{nginx_pid}/task/{nginx_pid}/children").read_text().split()]
    total_s = 2 + args.pairs * 2 * (args.window + 0.5) + 10  # ample: wrk is stopped after the last window
    wrk_proc = subprocess.Popen(["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{int(total_s)}s",
                                 f"http://127.0.0.1:{port}/"], stdout=subprocess.DEVNULL)
    pairs = []
    try:
        time.sleep(1.5)  # wrk's connections up (established while attached: the probes track them)
        for pair in range(args.pairs):
            rates = {}
            # Alternate which side comes first, so a trend in the machine's speed favours neither.
            for attached in ((False, True) if pair % 2 == 0 else (True, False)):
                if attached and not t.on.is_set():
                    t.attach()
                elif not attached and t.on.is_set():
                    t.detach()
                time.sleep(0.1)  # past the switch
                pids = workers + [wrk_proc.pid, os.getpid()]
                c0, t0, u0 = nginx_requests(status_port), time.monotonic(), cpu_s(pids)
                time.sleep(args.window)
                c1, t1, u1 = nginx_requests(status_port), time.monotonic(), cpu_s(pids)
                rates[attached] = Window((c1 - c0) / (t1 - t0), (u1 - u0) / max(c1 - c0, 1))
            pairs.append((rates[False], rates[True]))
        if wrk_proc.poll() is not None:
            raise RuntimeError("wrk ended before the last window: the windows did not all see load")
    finally:
        wrk_proc.terminate()
        wrk_proc.wait(10)
        t.close()
    return pairs, t.lat.mode


# What empty_programs() puts at the top of each probe, by the file it is in, and how many probes of each kind that file
# has: the tracepoint (raw or not) and kprobe functions return 0, the cgroup_skb programs let the packet pass, and
# sockops' sendmsg callback returns (connection set-up still picks the sockets, or no per-socket callback would fire).
_PROBE = r"(?:RAW_)?TRACEPOINT_PROBE\([^)]*\)|int kp_\w+\(struct pt_regs \*ctx\)"
_SKB = r"int lat_(?:ingress|ingress_learn|egress|egress_learn|adopt_ingress)\(struct __sk_buff \*skb\)"
_SENDMSG = r"static __always_inline void lat_ops_sendmsg\(struct bpf_sock_ops \*skops\)"
_EMPTIED = {
    # file: ((signature, early return, count), ...)
    "latency_trace.c": ((_PROBE, "return 0;", 7),),  # 4 tracepoints, 3 kprobes of the < 6.6 fallback
    "latency_trace_skb.c": ((_SKB, "return 1;", 2),),  # lat_egress, lat_adopt_ingress
    "latency_sockops.c": ((_SKB, "return 1;", 4), (_SENDMSG, "return;", 1)),
    "latency_runq.c": ((_PROBE, "return 0;", 3),),
}


def empty_programs(to: Path) -> str:
    """bpf/ copied to `to`, each latency probe returning before its first statement, in every file a mode's build
    is made of (qosagent.latency.datapath.sources): the tracepoint and kprobe probes of trace mode and the run-queue,
    the cgroup_skb programs of both modes (lat_egress_framing, tail-called by lat_egress only, never runs), and the
    sock_ops sendmsg callback. A file that no longer has the probes counted here stops the bench."""
    shutil.copytree(REPO / "bpf", to, dirs_exist_ok=True)
    for name, edits in _EMPTIED.items():
        out = (to / name).read_text()
        for signature, ret, want in edits:
            out, n = re.subn(rf"^((?:{signature})\n\{{\n)", rf"\1    if (1)\n        {ret}\n", out, flags=re.M)
            if n != want:
                raise RuntimeError(f"bpf/{name} has {n} probes like {signature!r}, not the {want} this bench empties")
        (to / name).write_text(out)
    return str(to)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40, help="pairs of (without, with) windows in one wrk run")
    ap.add_argument("--window", type=float, default=0.5, help="seconds per window")
    ap.add_argument("--restarts", type=int, default=3, help="agent processes started for ready time, CPU and RSS")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--no-runqueue", action="store_true", help="measure with latency.runqueue.enabled: false")
    ap.add_argument("--unwatched", action="store_true",
                    help="watch another port than nginx's: every probe event a miss (the noise floor of the bench)")
    ap.add_argument("--no-tick", action="store_true",
                    help="probes attached but the agent never reads them: what the kernel side alone costs")
    ap.add_argument("--no-arrival", action="store_true",
                    help="windows without the sk_data_ready hook (requests timed from their first read): what the "
                         "arrival clock costs; the agent processes keep it")
    ap.add_argument("--empty-programs", action="store_true",
                    help="every probe returns at once: what attaching to these hooks costs before any work (a copy "
                         "of bpf/ with a return at the top of each probe, through QOSAGENT_BPF_DIR)")
    ap.add_argument("--mode", default="auto", choices=("auto", "sockops", "tracepoint"),
                    help="latency.mode of the agent (auto: sockops on kernels that have it)")
    ap.add_argument("--adopting", action="store_true",
                    help="keep a connection opened before each agent idle: its adoption hooks stay on (tracepoint "
                         "mode: lat_adopt_ingress on the cgroup2 root)")
    ap.add_argument("--root-cgroup", action="store_true",
                    help="leave nginx in the bench's own cgroup (the root, on a host without systemd) instead of one "
                         "of its own as a systemd service would have: sockops mode then hooks wrk's arrivals too")
    args = ap.parse_args()
    for tool in ("nginx", "wrk", "bpftool"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed (make setup-test installs it)")
    tmp = Path(tempfile.mkdtemp(prefix="qosagent-bench-"))
    if args.empty_programs:
        os.environ["QOSAGENT_BPF_DIR"] = empty_programs(tmp / "bpf")  # read by the loader, here and in agents
    port, status_port = free_port(), free_port()
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp, port=port, status_port=status_port))
    serving_cgroup = None
    nginx_argv = ["nginx", "-c", str(tmp / "nginx.conf"), "-p", str(tmp)]
    if not args.root_cgroup:
        sys.path.insert(0, str(REPO))
        from qosagent.cgroups import cgroup2_mount
        from qosagent.hostfs import HostFS

        root = cgroup2_mount(HostFS("/"))
        if root:
            serving_cgroup = f"{root}/qosagent-bench-{os.getpid()}"
            os.mkdir(serving_cgroup)
            # In place before nginx opens its sockets: a socket belongs to the cgroup that created it.
            nginx_argv = ["sh", "-c", f'echo $$ > {serving_cgroup}/cgroup.procs && exec "$@"', "sh"] + nginx_argv
    nginx = subprocess.Popen(nginx_argv)
    idle = IdleConnection(port) if args.adopting else None
    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats_path.read_text().strip()
    try:
        time.sleep(0.5)
        wrk(port, 1, args.threads, args.connections)  # warm up nginx and the page cache
        if idle is not None:
            idle.refresh()
        pairs, t_mode = throughput_windows(port, status_port, nginx.pid, tmp, serving_cgroup, args)
        ready, idle_cpu, load_cpu, rss_idle, rss_load = [], [], [], [], []
        per_event: dict[str, list[float]] = {}
        per_request: dict[str, list[float]] = {}
        probe_ns_per_req: list[float] = []
        cpu_ns_per_req: list[float] = []
        for _ in range(args.restarts):
            if idle is not None:
                idle.refresh()
            agent = Agent(tmp, free_port() if args.unwatched else port, runq=not args.no_runqueue, mode=args.mode)
            try:
                ready.append(agent.ready_s)
                time.sleep(1.0)  # past the first ticks
                c0, t0 = agent.cpu_s(), time.monotonic()
                time.sleep(2.0)
                idle_cpu.append((agent.cpu_s() - c0) / (time.monotonic() - t0))
                rss_idle.append(agent.rss_mb())
                c0, t0 = agent.cpu_s(), time.monotonic()
                wrk(port, 3, args.threads, args.connections)
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
                    # The root-wide learner runs only in an agent's first seconds (LEARN_S), as it does here: its
                    # runs are shown per event but are not part of the steady state's cost per request.
                    if not name.endswith("_learn"):
                        total_ns += d_ns
                    if d_cnt:
                        per_event.setdefault(name, []).append(d_ns / d_cnt)
                        per_request.setdefault(name, []).append(d_cnt / (stats_rps * 2))
                # Noise-free view of the same cost: BPF time per request against the CPU time a request gets.
                requests = stats_rps * 2
                probe_ns_per_req.append(total_ns / requests)
                cpu_ns_per_req.append(os.cpu_count() * 2 * 1e9 / requests)
            finally:
                agent.stop()
    finally:
        stats_path.write_text(stats_before)
        if idle is not None:
            idle.close()
        nginx.terminate()
        nginx.wait(timeout=10)
        if serving_cgroup:
            os.rmdir(serving_cgroup)
        shutil.rmtree(tmp, ignore_errors=True)

    ratios = [w.rps / wo.rps for wo, w in pairs]
    med = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4)
    # CPU per request without / with: below 1 when the probes cost CPU, comparable with the req/s ratio (both CPUs
    # are saturated, so req/s is the inverse of CPU per request) but blind to other load on the machine.
    cpu_ratios = [wo.cpu_per_request_s / w.cpu_per_request_s for wo, w in pairs if w.cpu_per_request_s > 0]
    cmed = statistics.median(cpu_ratios)
    cq = statistics.quantiles(cpu_ratios, n=4)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"### Latency probes ({when}, {os.cpu_count()} CPUs shared, kernel {os.uname().release})\n")
    print(f"nginx (1 worker, `return 200`) on loopback, one run of wrk -t{args.threads} -c{args.connections}; "
          f"{args.pairs} pairs of {args.window:g} s windows without and with the probes attached (order alternating), "
          f"run-queue probes {'off' if args.no_runqueue else 'on'}"
          f"{', nginx port not watched' if args.unwatched else ''}"
          f"{', every probe empty (returns at once)' if args.empty_programs else ''}"
          f"{', agent tick off (maps never read)' if args.no_tick else ''}"
          f"{', no arrival hook (requests timed from their first read)' if args.no_arrival else ''}"
          f"{', a connection awaiting adoption (its hooks on)' if args.adopting else ''}; "
          f"latency.mode {t_mode}, nginx in {serving_cgroup or 'the bench process cgroup'}.\n")
    base = [wo.rps for wo, _ in pairs]
    print(f"Without: median {statistics.median(base):,.0f} req/s (range {min(base):,.0f}-{max(base):,.0f}); "
          f"req/s with/without per pair: quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}, range "
          f"{min(ratios):.3f}-{max(ratios):.3f}.\n")
    print(f"**Median ratio {med:.3f}** ({(1 - med) * 100:+.1f} % fewer req/s; target <= 3 %).\n")
    print(f"CPU time per request (nginx + wrk + agent), without/with: **median {cmed:.3f}** "
          f"({(1 / cmed - 1) * 100:+.1f} % more CPU per request), quartiles {cq[0]:.3f} / {cq[1]:.3f} / "
          f"{cq[2]:.3f}.\n")
    pr, cr = statistics.median(probe_ns_per_req), statistics.median(cpu_ns_per_req)
    print(f"BPF run time per request (steady state, without the start-up learner): **{pr:,.0f} ns** of "
          f"~{cr:,.0f} ns CPU per request "
          f"({os.cpu_count()} CPUs x run / requests): **{pr / cr * 100:.1f} %** of the machine's CPU time.\n")
    print("| program | ns per event | events per request |\n|---|---|---|")
    for name, vals in sorted(per_event.items()):
        print(f"| {name} | {statistics.median(vals):.0f} | {statistics.median(per_request[name]):.2f} |")
    print(f"\n| agent ({args.restarts} `qosagent run` processes) | median | max | target |\n|---|---|---|---|")
    print(f"| CPU idle (% of one core) | {statistics.median(idle_cpu) * 100:.2f} | {max(idle_cpu) * 100:.2f} | <= 2 |")
    print(f"| CPU under load (% of one core) | {statistics.median(load_cpu) * 100:.2f} "
          f"| {max(load_cpu) * 100:.2f} | - |")
    print(f"| RSS idle (MB) | {statistics.median(rss_idle):.0f} | {max(rss_idle):.0f} | <= 150 |")
    print(f"| RSS under load (MB) | {statistics.median(rss_load):.0f} | {max(rss_load):.0f} | <= 150 |")
    print(f"| start to ready (s) | {statistics.median(ready):.2f} | {max(ready):.2f} | <= 3 |")


if __name__ == "__main__":
    main()
