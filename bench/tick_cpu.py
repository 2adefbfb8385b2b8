"""The agent's tick, CPU per tenant: the whole Agent.tick() (every enabled capability's maintain, collect, decide and
apply, the services, the Snapshot) with quota, latency, servers and admission (dry-run) on real BPF, for N port
tenants, by the calling thread's CPU time, in interleaved rounds of two checkouts on the same machine.

Run as root: `python bench/tick_cpu.py BEFORE_CHECKOUT AFTER_CHECKOUT [--tenants 3,30,300] [--rounds 2]
[--ticks 100]`, e.g. a `git worktree` of the commit before and this checkout. Each round runs, in a fresh child
process per checkout and tenant count, that checkout's Agent (its own code and BPF) in a network namespace of its
own (quota's filter on that namespace's lo, its pins under a bpffs directory of its own, both removed at the end),
ticks it `--ticks` times 50 ms apart after ten untimed ones, and reports the thread CPU time of each tick. No
traffic: what a tick costs for the tenants it keeps, idle. Prints a Markdown table for docs/PERFORMANCE.md: median
tick CPU in µs, per tenant, and the ratio after/before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import uuid

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from qosagent.config import parse
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS

n, ticks, pins = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tiers = ("gold", "silver", "bronze")
ports = [20000 + i for i in range(n)]
cfg = parse({"interval": "50ms", "metrics": {"enabled": False},
             "tenants": [{"name": f"t{i}", "tier": tiers[i % 3], "match": {"ports": [p]},
                          "quota": {"rps": 1000, "burst": 100}} for i, p in enumerate(ports)],
             "latency": {"ports": ports},
             "quota": {"enabled": True, "interfaces": ["lo"]},
             "admission": {"enabled": True, "mode": "dry-run"},
             "bpf": {"pin_root": pins}}, "bench")
agent = Agent(cfg, HostFS("/"), None, gpu=NoGpu("bench"))
agent.ctx.detach_on_exit = True
agent.start()
states = {k: v.state.value for k, v in agent.verdicts.items()}
try:
    for _ in range(10):
        agent.tick()
        time.sleep(0.05)
    cpu = []
    for _ in range(ticks):
        t0 = time.thread_time()
        agent.tick()
        cpu.append(time.thread_time() - t0)
        time.sleep(0.05)
finally:
    agent.stop()
print(json.dumps({"cpu": cpu, "states": states}))
"""


def in_netns(code: str, *args: str, timeout: int = 600) -> dict:
    """`python -c code *args PINS` in a network namespace of its own, PINS a bpffs directory of its own, both removed
    after; its last line of output, as JSON."""
    ns = f"qosbench-{uuid.uuid4().hex[:8]}"
    pins = f"/sys/fs/bpf/{ns}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the host's bpffs.
        out = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", code, *args, pins],
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{args}: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        subprocess.run(["rm", "-rf", pins], check=False)


def one(checkout: str, n: int, ticks: int) -> dict:
    return in_netns(CHILD, checkout, str(n), str(ticks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--tenants", default="3,30,300")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ticks", type=int, default=100)
    a = ap.parse_args()
    counts = [int(x) for x in a.tenants.split(",")]
    cpu: dict[tuple[str, int], list[float]] = {}
    rounds: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for n in counts:
            for label, checkout in (("before", a.before), ("after", a.after))[:: 1 if r % 2 == 0 else -1]:
                res = one(checkout, n, a.ticks)
                if r == 0:
                    print(f"{label} n={n}: {res['states']}", file=sys.stderr)
                cpu.setdefault((label, n), []).extend(res["cpu"])
                rounds.setdefault((label, n), []).append(statistics.median(res["cpu"]) * 1e6)
    print("| tenants | tick CPU before (µs) | after (µs) | per tenant before | after | after/before |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        b = statistics.median(cpu[("before", n)]) * 1e6
        f = statistics.median(cpu[("after", n)]) * 1e6
        print(f"| {n} | {b:.0f} | {f:.0f} | {b / n:.1f} | {f / n:.1f} | {f / b:.3f} |")
    print("\nmedian tick CPU (µs) of each round, before / after:")
    for n in counts:
        print(f"  {n}: " + ", ".join(f"{b:.0f}/{f:.0f}" for b, f in zip(rounds[("before", n)], rounds[("after", n)])))


if __name__ == "__main__":
    main()
