"""The quota classifier on the wire: where its cost over a veth pair goes. nginx in one network namespace, wrk in
another, the classifier's hook on the server's veth ingress (where the agent puts it for `quota.interfaces`). In
interleaved rounds (the order rotated each round), with:

- nothing on the device (the round's baseline);
- a clsact qdisc and no filter (the hook itself);
- clsact + an empty direct-action cls_bpf program returning TC_ACT_OK, at our prio and handle;
- clsact + the least a per-request token bucket does here (FLOOR_PROG: the headers read in place, a request's first
  payload bytes copied, the clock read, one compare-and-swap);
- clsact + our program from its pins, its maps written for the tenant (the program alone, no agent running);
- our program as the agent attaches it, the agent running (its ticks share the machine's CPUs).

One tenant claims nginx's port with a quota that never runs dry, so every request start takes a token and is
counted. Two measures each run:
- req/s, as wrk reports it; its cost is 1 - req/s / the round's baseline. On 2 shared CPUs this moves with whatever
  else runs on the machine (another worker's VM, tests).
- the wire's CPU time per request: nginx's worker, wrk and ksoftirqd (the packets' softirq work runs on their
  stacks), from the scheduler's clock, over wrk's requests; its cost is 1 - baseline / this, the req/s ratio two
  CPU-bound ends would see, without what other processes took.
Then, with kernel.bpf_stats_enabled=1 (restored after), each program's ns per run and runs per request on the same
traffic; with --perf also, from perf's samples of the whole machine, each program's ns per request in the tc hook and
in its parts (the clock, the payload copy, its own instructions).

Run as root from the checkout: python bench/quota_wire_bench.py [--rounds N] [--seconds S] [--perf]. Prints a Markdown
section for docs/PERFORMANCE.md ("The classifier on the wire")."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qosagent.config import parse  # noqa: E402
from qosagent.ebpf.libbpf import obj_pin  # noqa: E402
from qosagent.quota import datapath as dp  # noqa: E402
from qosagent.quota.rules import baseline_buckets  # noqa: E402
from testkit.agent import AgentProcess  # noqa: E402

SRV_ADDR, CLI_ADDR, PORT = "198.18.11.1", "198.18.11.2", 8100
NONE, CLSACT, EMPTY, FLOOR, OURS, AGENT = (
    "no qdisc (baseline)", "clsact, no filter", "clsact + empty cls_bpf (da, TC_ACT_OK)",
    "clsact + a bucket's least work (FLOOR_PROG)", "clsact + ours, program alone (maps written, no agent)",
    "ours as the agent attaches it, agent running")
# What any classifier that takes a token per HTTP request must do on this wire: see the request line (TCP from a
# local socket carries its payload outside the linear area, so bpf_skb_load_bytes), read the clock and update a
# shared bucket atomically. IPv4 only, headers in place, no tenant, no counters.
FLOOR_PROG = b"""#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/tcp.h>
BPF_ARRAY(floor_tat, u64, 1);
int bucket_floor(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
    struct iphdr *ip = data + ETH_HLEN;
    if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP)
        return TC_ACT_OK;
    struct tcphdr *tcp = (void *)ip + ip->ihl * 4;
    if ((void *)(tcp + 1) > end)
        return TC_ACT_OK;
    u32 off = ETH_HLEN + ip->ihl * 4 + tcp->doff * 4, w;
    if (skb->len < off + 16 || bpf_skb_load_bytes(skb, off, &w, 4) < 0 || w != 0x20544547) /* "GET " */
        return TC_ACT_OK;
    u32 zero = 0;
    u64 *tat = floor_tat.lookup(&zero);
    if (tat) {
        u64 now = bpf_ktime_get_ns(), old = *tat;
        __sync_val_compare_and_swap(tat, old, (old > now ? old : now) + 1000);
    }
    return TC_ACT_OK;
}"""
PROGRAMS = {
    EMPTY: ("empty", b"""#include <uapi/linux/pkt_cls.h>
int empty(struct __sk_buff *skb) { return TC_ACT_OK; }"""),
    FLOOR: ("bucket_floor", FLOOR_PROG),
}
NGINX_CONF = """worker_processes 1; daemon off; pid {tmp}/nginx.pid; error_log {tmp}/error.log;
events {{ worker_connections 1024; }}
http {{ access_log off; client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp};
  uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
  server {{ listen {addr}:{port}; location / {{ return 200 "ok"; }} }} }}
"""
TENANT = {"name": "bench", "tier": "gold", "match": {"ports": [PORT]}, "quota": {"rps": 1e9, "burst": 1000000}}


def sh(*a: str) -> str:
    return subprocess.run(a, check=True, capture_output=True, text=True).stdout


def runtime_ns(pid: int) -> int:
    """CPU time a process's threads have run, from the scheduler's clock (softirq work done on their stacks counts
    with it: this kernel has no IRQ time accounting)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return total


@dataclass
class Run:
    rps: float
    requests: int
    cpu_ns: float  # the wire's CPU per request
    agent_cpu: float = 0.0  # the agent's share of one CPU over the run


class Wire:
    def __init__(self, tmp: Path, tag: str):
        self.tmp = tmp
        self.srv, self.cli = f"qa-wire-{tag}-s", f"qa-wire-{tag}-c"
        self.agent_pins = f"/sys/fs/bpf/qosagent-wire-{tag}-a"
        self.prog_pins = f"/sys/fs/bpf/qosagent-wire-{tag}-p"
        self.pins = {k: f"/sys/fs/bpf/qosagent-wire-{tag}-{fn}" for k, (fn, _) in PROGRAMS.items()}
        self.procs: list[subprocess.Popen] = []
        self.keep: list[object] = []  # the bench programs' BPF objects (their maps)
        self.datapath: dp.Datapath | None = None
        self.agent: AgentProcess | None = None
        self.nginx_worker = 0
        self.softirqd = [int(p) for p in sh("pgrep", "-x", "ksoftirqd/[0-9]+").split()]
        self.cfg = parse({"bpf": {"pin_root": self.prog_pins}, "latency": {"enabled": False, "ports": [8000]},
                          "quota": {"enabled": True, "interfaces": ["vs"]}, "tenants": [TENANT]}, "bench")
        self.pins[OURS] = f"{dp.pin_dir(self.cfg)}/{dp.PROG_PIN}"

    def up(self) -> None:
        for ns in (self.srv, self.cli):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", self.srv, "link", "add", "vs", "type", "veth", "peer", "name", "vc", "netns", self.cli)
        sh("ip", "-n", self.srv, "addr", "add", f"{SRV_ADDR}/24", "dev", "vs")
        sh("ip", "-n", self.cli, "addr", "add", f"{CLI_ADDR}/24", "dev", "vc")
        sh("ip", "-n", self.srv, "link", "set", "vs", "up")
        sh("ip", "-n", self.cli, "link", "set", "vc", "up")
        (self.tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=self.tmp, addr=SRV_ADDR, port=PORT))
        master = subprocess.Popen(["ip", "netns", "exec", self.srv, "nginx", "-c", str(self.tmp / "nginx.conf")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(master)
        from bcc import BPF

        for key, (fn, text) in PROGRAMS.items():
            b = BPF(text=text)
            obj_pin(b.load_func(fn.encode(), BPF.SCHED_CLS).fd, self.pins[key])
            self.keep.append(b)
        self.datapath = dp.Datapath(self.cfg)
        self.datapath.write_config(self.cfg, baseline_buckets(self.cfg))
        (self.tmp / "agent.yaml").write_text(f"""
status: {{socket: {self.tmp}/s.sock}}
metrics: {{enabled: false}}
bpf: {{pin_root: {self.agent_pins}}}
latency: {{enabled: false, ports: [8000]}}
quota: {{enabled: true, interfaces: [vs]}}
tenants:
  - {json.dumps(TENANT)}
""")
        for _ in range(50):
            kids = subprocess.run(["pgrep", "-P", str(master.pid)], capture_output=True, text=True).stdout.split()
            if kids:
                self.nginx_worker = int(kids[0])
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("nginx started no worker")

    def tc(self, *args: str) -> str:
        # nsenter, not `tc -n`: that remounts /sys, hiding the pinned programs.
        return sh("nsenter", f"--net=/run/netns/{self.srv}", "tc", *args)

    def clsact(self) -> None:
        self.tc("qdisc", "add", "dev", "vs", "clsact")

    def filter(self, pin: str) -> None:
        q = self.cfg.quota
        self.clsact()
        self.tc("filter", "add", "dev", "vs", "ingress", "prio", str(q.tc_prio), "handle", hex(q.tc_handle), "bpf",
                "da", "object-pinned", pin)

    def clear(self) -> None:
        self.tc("qdisc", "del", "dev", "vs", "clsact")

    def start_agent(self) -> None:
        self.agent = AgentProcess(self.tmp / "agent.yaml", f"{self.tmp}/s.sock", self.tmp / "agent.log",
                                  prefix=["nsenter", f"--net=/run/netns/{self.srv}"], args=["--detach-on-exit"])
        self.agent.start()

    def stop_agent(self) -> None:
        assert self.agent is not None
        self.agent.stop()
        self.agent = None

    def variants(self) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
        """Each case's (set up, take down)."""
        def nothing() -> None:
            pass

        def program(key: str) -> Callable[[], None]:
            return lambda: self.filter(self.pins[key])

        return {NONE: (nothing, nothing), CLSACT: (self.clsact, self.clear), EMPTY: (program(EMPTY), self.clear),
                FLOOR: (program(FLOOR), self.clear), OURS: (program(OURS), self.clear),
                AGENT: (self.start_agent, self.stop_agent)}

    def wrk(self, seconds: int) -> Run:
        agent = self.agent.proc.pid if self.agent is not None and self.agent.proc is not None else 0
        before = [runtime_ns(p) for p in (self.nginx_worker, *self.softirqd)]
        agent0 = runtime_ns(agent) if agent else 0
        p = subprocess.Popen(["ip", "netns", "exec", self.cli, "wrk", "-t1", "-c16", f"-d{seconds}s",
                              f"http://{SRV_ADDR}:{PORT}/"], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)  # wrk's own CPU, all its threads (`ip netns exec` execs it)
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode:
            raise RuntimeError(f"wrk failed ({p.returncode}): {out}")
        after = [runtime_ns(p) for p in (self.nginx_worker, *self.softirqd)]
        agent_ns = runtime_ns(agent) - agent0 if agent else 0
        n = int(re.search(r"(\d+) requests in", out).group(1))
        cpu = sum(after) - sum(before) + (usage.ru_utime + usage.ru_stime) * 1e9
        return Run(float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), n, cpu / n,
                   agent_ns / (seconds * 1e9))

    def prog_stats(self, pin: str) -> tuple[int, int]:
        """(run_time_ns, run_cnt) of a pinned program; both 0 while kernel.bpf_stats_enabled is off."""
        info = json.loads(sh("bpftool", "-j", "prog", "show", "pinned", pin))
        return info.get("run_time_ns", 0), info.get("run_cnt", 0)

    def down(self) -> None:
        if self.agent is not None:
            self.agent.kill()
        for p in self.procs:
            p.terminate()
            p.wait(10)
        for ns in (self.srv, self.cli):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.datapath is not None:
            self.datapath.close()
        for d in (self.agent_pins, self.prog_pins):
            shutil.rmtree(d, ignore_errors=True)
        for key in PROGRAMS:
            if os.path.exists(self.pins[key]):
                os.unlink(self.pins[key])


def on_wire_ns(w: Wire, seconds: int) -> dict[str, tuple[float, float]]:
    """Per program on the same traffic, with bpf_stats on: (ns per run, runs per request)."""
    out = {}
    old = sh("sysctl", "-n", "kernel.bpf_stats_enabled").strip()
    sh("sysctl", "-q", "kernel.bpf_stats_enabled=1")
    try:
        for key in (EMPTY, FLOOR, OURS):
            w.filter(w.pins[key])
            ns0, c0 = w.prog_stats(w.pins[key])
            n = w.wrk(seconds).requests
            ns1, c1 = w.prog_stats(w.pins[key])
            w.clear()
            out[key] = ((ns1 - ns0) / max(1, c1 - c0), (c1 - c0) / n)
    finally:
        sh("sysctl", "-q", f"kernel.bpf_stats_enabled={old}")
    return out


PERF_PERIOD_NS = 250_000
# Where a sample is counted (inclusive: anywhere in its call chain), by the first frame that names it.
PERF_PARTS = {"the tc hook (tcf_classify, all of it)": ("tcf_classify",),
              "the clock (bpf_ktime_get_ns)": ("bpf_ktime_get_ns", "ktime_get_mono_fast_ns"),
              "the payload copy (bpf_skb_load_bytes)": ("bpf_skb_load_bytes", "skb_copy_bits")}


def perf_split(w: Wire, seconds: int) -> dict[str, dict[str, float]]:
    """Per program: ns per request in each of PERF_PARTS and in the program's own instructions, from perf's
    cpu-clock samples of the whole machine while wrk runs."""
    out: dict[str, dict[str, float]] = {}
    data = str(w.tmp / "perf.data")
    for key in (EMPTY, FLOOR, OURS):
        w.filter(w.pins[key])
        wrk = subprocess.Popen(["ip", "netns", "exec", w.cli, "wrk", "-t1", "-c16", f"-d{seconds + 2}s",
                                f"http://{SRV_ADDR}:{PORT}/"], stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        rx0 = int(sh("ip", "netns", "exec", w.srv, "cat", "/sys/class/net/vs/statistics/rx_packets"))
        sh("perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERF_PERIOD_NS), "-a", "-g", "-o", data, "--",
           "sleep", str(seconds))
        rx1 = int(sh("ip", "netns", "exec", w.srv, "cat", "/sys/class/net/vs/statistics/rx_packets"))
        wrk.communicate()
        w.clear()
        # requests: packets into the server's veth (one a request here: runs per request is 1.00)
        out[key] = {k: c * PERF_PERIOD_NS / max(1, rx1 - rx0) for k, c in perf_counts(data).items()}
    return out


def perf_counts(data: str) -> dict[str, int]:
    """Samples in each of PERF_PARTS and in BPF programs' own instructions."""
    counts = dict.fromkeys([*PERF_PARTS, "the program's own instructions"], 0)
    chain: list[str] = []
    for line in [*sh("perf", "script", "-i", data, "-F", "comm,ip,sym").splitlines(), ""]:
        if line.strip() and line[0].isspace():  # a frame: address, symbol
            chain.append(line.split()[1] if len(line.split()) > 1 else "")
            continue
        if chain:  # a sample's chain ended
            syms = set(chain)
            for part, names in PERF_PARTS.items():
                counts[part] += any(n in syms for n in names)
            counts["the program's own instructions"] += chain[0].startswith("bpf_prog_")
        chain = []
    return counts


def spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else xs * 3
    return f"{statistics.median(xs):.4f} ({q[0]:.4f} / {q[2]:.4f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--perf", action="store_true", help="also split the programs' cost by perf's samples")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="qa-wire-"))
    w = Wire(tmp, uuid.uuid4().hex[:6])
    load0 = os.getloadavg()
    started = datetime.now(timezone.utc)
    try:
        w.up()
        variants = w.variants()
        names = list(variants)
        w.wrk(1)  # warm nginx, wrk and the pair
        runs: dict[str, list[Run]] = {k: [] for k in names}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                setup, teardown = variants[name]
                setup()
                time.sleep(0.5)
                runs[name].append(w.wrk(a.seconds))
                teardown()
        ns = on_wire_ns(w, a.seconds)
        split = perf_split(w, a.seconds) if a.perf else {}
    finally:
        w.down()
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    base = runs[NONE]
    rps_cost = {k: [1 - x.rps / b.rps for x, b in zip(v, base)] for k, v in runs.items() if k != NONE}
    cpu_cost = {k: [1 - b.cpu_ns / x.cpu_ns for x, b in zip(v, base)] for k, v in runs.items() if k != NONE}
    print("## The classifier on the wire\n")
    print(f"{started:%Y-%m-%d %H:%M} UTC, kernel {platform.release()}, {os.cpu_count()} CPUs (shared); load average "
          f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end; nginx `return 200` (1 worker) and `wrk -t1 -c16` "
          f"over a veth pair, the hook on the server's ingress; {a.rounds} interleaved rounds of {a.seconds} s; "
          f"`python bench/quota_wire_bench.py --rounds {a.rounds} --seconds {a.seconds}`. Costs are medians over "
          "the rounds of each round's own ratio to its baseline (quartiles in brackets).\n")
    print("| on the server's veth ingress | req/s | cost by req/s | wire CPU per request | cost by CPU |")
    print("|---|---:|---:|---:|---:|")
    for k, v in runs.items():
        rc, cc = rps_cost.get(k), cpu_cost.get(k)
        print(f"| {k} | {statistics.median(x.rps for x in v):.0f} | {'' if rc is None else spread(rc)} | "
              f"{statistics.median(x.cpu_ns for x in v):.0f} ns | {'' if cc is None else spread(cc)} |")
    print()
    for k in (FLOOR, OURS, AGENT):
        for what, cost in (("req/s", rps_cost), ("CPU", cpu_cost)):
            e = statistics.median(cost[EMPTY])
            print(f"- {k}, by {what}: {statistics.median(cost[k]) / e:.2f}x the empty program's cost")
    print(f"- the agent took {statistics.median(x.agent_cpu for x in runs[AGENT]):.3f} of a CPU while it ran")
    print(f"\nWith kernel.bpf_stats_enabled=1, {a.seconds} s of the same traffic each:\n")
    print("| program | ns per run | runs per request |")
    print("|---|---:|---:|")
    for k, (per_run, per_req) in ns.items():
        print(f"| {k} | {per_run:.0f} | {per_req:.2f} |")
    if split:
        parts = list(next(iter(split.values())))
        print(f"\nperf's cpu-clock samples (every {PERF_PERIOD_NS // 1000} µs, all CPUs, {a.seconds} s each), ns per "
              "request:\n")
        print("| program | " + " | ".join(parts) + " |")
        print("|---|" + "---:|" * len(parts))
        for k, v in split.items():
            print(f"| {k} | " + " | ".join(f"{v[p]:.0f}" for p in parts) + " |")


if __name__ == "__main__":
    main()
