"""The agent's own footprint with latency, quota and admission (dry-run) on: resident memory when steady, the peak
during start (the agent and its compile children together, resident and proportional), time to ready (and the
agent's CPU time until then) on a cold start (no pins) and on a restart with nothing changed (warm), idle CPU, and
the pages of LLVM, clang and BCC mapped into the agent; for two checkouts in interleaved rounds on the same machine.

Run as root: `python bench/lean_agent.py BEFORE_CHECKOUT AFTER_CHECKOUT [--rounds 3] [--idle 10]`, e.g. a
`git worktree` of the commit before and this checkout. Each round starts, per checkout, `qosagent run` of that
checkout (`python -P -m qosagent` with it on PYTHONPATH, the working directory kept off the path) in a network
namespace of its own (quota's filter on that namespace's lo, pins under a bpffs directory of its own), once with no
pins (cold), stops it (a clean stop keeps what a restart may reuse), starts it again (warm) and stops it with
--detach-on-exit. Both checkouts' bytecode is compiled first, as an installed package's is. Ready is the status
socket's first answer with a tick done, timed from the process's launch (asked every 20 ms); CPU times are read
from /proc when it is ready (its children's from the kernel's count of every child it waited for: the two compile
children, and the tools it ran, such as quota planning's `bpftool -j net show`). No tenant's traffic; with
`--read-server`, an idle vLLM-like server on the watched port whose metrics the agent reads every second there, as
on a real inference host (requests no tenant claims). Prints a Markdown table for docs/PERFORMANCE.md: the median
over rounds of each measure, and after/before.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testkit.agent import AgentProcess  # noqa: E402

COMPILER = ("libLLVM", "libclang", "libbcc")
TICK_S = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _kb(path: str, field: str) -> int:
    """The kB of `field` in a /proc file of `field: N kB` lines; 0 once the process is gone."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kb(pid: int) -> int:
    return _kb(f"/proc/{pid}/status", "VmRSS:")


def pss_kb(pid: int) -> int:
    """Proportional set size: a page shared by n processes counts 1/n in each, so a sum over processes counts
    the compile children's LLVM once (resident memory counts it in each child)."""
    return _kb(f"/proc/{pid}/smaps_rollup", "Pss:")


def compiler_kb(pid: int) -> int:
    """Resident kB of the agent's mappings of LLVM, clang and BCC."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5:
                counting = len(parts) >= 6 and any(c in parts[5] for c in COMPILER)
            elif counting and parts[0] == "Rss:":
                total += int(parts[1])
    return total


def cpu_s(pid: int, children: bool = False) -> float:
    """CPU time of the process, or (children) of every child it has waited for (cutime, cstime): the compile children
    once done, and the tools it ran (quota planning's bpftool), which the kernel's count does not tell apart."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    i = 13 if children else 11
    return (int(fields[i]) + int(fields[i + 1])) / TICK_S  # utime, stime or cutime, cstime


class Peak(threading.Thread):
    """The largest resident total of the agent and its children, the largest of any child alone and the largest
    proportional total, sampled every 20 ms until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.kb, self.child_kb, self.pss_kb, self.done = pid, 0, 0, 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            procs = tree(self.pid)
            sizes = [rss_kb(p) for p in procs]
            self.kb = max(self.kb, sum(sizes))
            self.child_kb = max([self.child_kb, *sizes[1:]])
            self.pss_kb = max(self.pss_kb, sum(pss_kb(p) for p in procs))
            self.done.wait(0.02)


def start(checkout: str, ns: str, tmp: Path, extra: tuple[str, ...], idle: float) -> dict[str, float]:
    cfg = tmp / "qosagent.yaml"
    sock = str(tmp / "status.sock")
    env = dict(os.environ, PYTHONPATH=checkout, PYTHONUNBUFFERED="1")
    agent = AgentProcess(cfg, sock, tmp / "agent.log", prefix=["nsenter", f"--net=/run/netns/{ns}"],
                         argv=[sys.executable, "-P", "-m", "qosagent", "run", "--config", str(cfg), *extra], env=env)
    agent.launch()
    assert agent.proc is not None
    peak = Peak(agent.proc.pid)
    try:
        st = agent.wait_ready(poll=0.02)  # the default 0.1 s would be a fifth of a warm start's 0.5 s
        # The agent's CPU time until ready: its own work, which other load on the machine delays but does not add to.
        ready_cpu = cpu_s(agent.proc.pid)
        children_cpu = cpu_s(agent.proc.pid, children=True)
        peak.done.set()
        states = {k: v.get("state") for k, v in st["capabilities"].items()}
        if states.get("quota") != "active" or states.get("latency") not in ("active", "degraded"):
            raise RuntimeError(f"{checkout}: {states}\n{agent.output()[-3000:]}")
        pid = agent.proc.pid
        time.sleep(2.0)  # past start's last work (the first ticks, the adopter's listing)
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(idle)
        idle_pct = 100 * (cpu_s(pid) - c0) / (time.monotonic() - t0)
        out = {"ready_s": agent.ready_s, "ready_cpu_s": ready_cpu, "children_cpu_s": children_cpu,
               "rss_mb": rss_kb(pid) / 1024, "peak_mb": peak.kb / 1024, "child_peak_mb": peak.child_kb / 1024,
               "peak_pss_mb": peak.pss_kb / 1024, "compiler_mb": compiler_kb(pid) / 1024, "idle_cpu_pct": idle_pct}
    finally:
        peak.done.set()
        rc = agent.stop()
        agent.kill()
    if rc != 0:
        raise RuntimeError(f"{checkout}: exit {rc}\n{agent.output()[-3000:]}")
    return out


def import_floor(checkout: str) -> float:
    """Seconds to start the interpreter and import what `qosagent run` imports before it does anything: the floor
    under any ready time."""
    env = dict(os.environ, PYTHONPATH=checkout)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-P", "-c", "import qosagent.cli, qosagent.daemon"], env=env, check=True)
    return time.monotonic() - t0


# An idle vLLM as the agent meets it (--read-server): its metrics on its API port, nothing running or waiting.
VLLM = """
import http.server
BODY = (b"vllm:num_requests_running 0\\nvllm:num_requests_waiting 0\\nvllm:kv_cache_usage_perc 0.0\\n"
        b"vllm:generation_tokens_total 0\\n")
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


def one(checkout: str, idle: float, read_server: bool) -> dict[str, dict[str, float]]:
    ns = f"qosbench-{uuid.uuid4().hex[:8]}"
    pins = f"/sys/fs/bpf/{ns}"
    tmp = Path(tempfile.mkdtemp(prefix="qosbench-", dir="/run"))
    # With a server read: gold matched by its clients' addresses, so the agent's reads (from 127.0.0.1) are no
    # tenant's, as docs/servers.md asks where the metrics are on the API port.
    gold = {"ports": [8000], "cidrs": ["198.18.0.0/15"]} if read_server else {"ports": [8000]}
    (tmp / "qosagent.yaml").write_text(yaml.safe_dump({
        "interval": "100ms", "state_dir": str(tmp), "status": {"socket": str(tmp / "status.sock")},
        "metrics": {"enabled": False}, "bpf": {"pin_root": pins},
        "latency": {"ports": [8000]}, "quota": {"enabled": True, "interfaces": ["lo"]},
        "admission": {"enabled": True, "mode": "dry-run"},
        "tenants": [{"name": "gold", "tier": "gold", "match": gold, "quota": {"rps": 100, "burst": 10}}],
        **({"servers": [{"port": 8000, "kind": "vllm"}]} if read_server else {}),
    }))
    subprocess.run(["ip", "netns", "add", ns], check=True)
    server = None
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        if read_server:
            server = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", VLLM])
        cold = start(checkout, ns, tmp, (), idle)
        warm = start(checkout, ns, tmp, ("--detach-on-exit",), idle)
        warm["import_s"] = import_floor(checkout)
        return {"cold": cold, "warm": warm}
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(pins, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


ROWS = (("steady RSS (MB)", "warm", "rss_mb"), ("LLVM/clang/BCC pages (MB)", "warm", "compiler_mb"),
        ("peak RSS during a cold start, agent + children (MB)", "cold", "peak_mb"),
        ("peak PSS during a cold start, agent + children (MB; shared pages counted once)", "cold", "peak_pss_mb"),
        ("peak RSS of a child alone (the compile child; MB)", "cold", "child_peak_mb"),
        ("cold ready (s)", "cold", "ready_s"), ("warm ready (s)", "warm", "ready_s"),
        ("the agent's CPU time until ready, cold (s; its compile children's not counted)", "cold", "ready_cpu_s"),
        ("the agent's CPU time until ready, warm (s)", "warm", "ready_cpu_s"),
        ("the waited-for children's CPU time, cold (s; both compile children, and tools such as quota planning's "
         "bpftool)", "cold", "children_cpu_s"),
        ("of which interpreter and imports (s)", "warm", "import_s"),
        ("idle CPU (% of a core)", "warm", "idle_cpu_pct"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured per start")
    ap.add_argument("--read-server", action="store_true",
                    help="an idle vLLM-like server on the watched port, whose metrics the agent reads every second")
    a = ap.parse_args()
    for checkout in (a.before, a.after):
        # Each checkout's bytecode compiled first, as pip compiles an installed package's (the image, the unit's
        # /opt/qosagent): a checkout run under PYTHONDONTWRITEBYTECODE=1 compiles every module from source at each
        # start, ~0.1 s of CPU no installed agent spends.
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(checkout, "qosagent")], check=True)
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"before": [], "after": []}
    for r in range(a.rounds):
        for label, checkout in (("before", a.before), ("after", a.after))[:: 1 if r % 2 == 0 else -1]:
            res = one(os.path.abspath(checkout), a.idle, a.read_server)
            runs[label].append(res)
            print(f"round {r} {label}: " + ", ".join(f"{k} " + " ".join(f"{m}={v:.2f}" for m, v in d.items())
                                                     for k, d in res.items()), file=sys.stderr)
    print("| measure | before | after | after/before |")
    print("|---|---|---|---|")
    for title, which, key in ROWS:
        b = statistics.median(r[which][key] for r in runs["before"])
        f = statistics.median(r[which][key] for r in runs["after"])
        print(f"| {title} | {b:.2f} | {f:.2f} | {f / b:.3f} |" if b else f"| {title} | {b:.2f} | {f:.2f} | – |")
    print("\nper round, before / after:")
    for title, which, key in ROWS:
        print(f"  {title}: " + ", ".join(f"{x[which][key]:.2f}/{y[which][key]:.2f}"
                                         for x, y in zip(runs["before"], runs["after"])))


if __name__ == "__main__":
    main()
