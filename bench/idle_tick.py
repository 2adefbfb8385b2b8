"""Where an idle agent's CPU goes, tick by tick: lean_agent.py's configuration (latency in sockops mode, quota on a
namespace's lo, admission dry-run, one tenant, no traffic) built as an Agent in a child process, ticked every 100 ms,
with each capability's and service's parts timed by thread CPU time; and the floor, the same loop with no capability
enabled.

Run as root: `python bench/idle_tick.py [CHECKOUT] [--ticks 300] [--rounds 2]`. Each run is a fresh child in a
network namespace and pin directory of its own (bench/tick_cpu.py's in_netns), ten untimed ticks, then `--ticks`
timed ones 100 ms apart. Prints the process's CPU (% of a core, every thread, the sleeps' wakeups included), the
tick's own CPU and a Markdown table of the parts in µs per tick (median over rounds). Quota's namespace follow and
its datapath's calls are timed inside quota.maintain and quota.collect: indented, part of the line above them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tick_cpu import in_netns  # noqa: E402

CHILD = r"""
import collections, json, logging, sys, time
sys.path.insert(0, sys.argv[1])
from qosagent import netns
from qosagent.config import parse
from qosagent.daemon import Agent
from qosagent.hostfs import HostFS
from qosagent.quota import tc

floor, ticks, pins = sys.argv[2] == "floor", int(sys.argv[3]), sys.argv[4]
logging.basicConfig(level=logging.INFO, handlers=[logging.NullHandler()])
raw = {"interval": "100ms", "metrics": {"enabled": False}, "bpf": {"pin_root": pins},
       "tenants": [{"name": "gold", "tier": "gold", "match": {"ports": [8000]}, "quota": {"rps": 100, "burst": 10}}]}
raw.update({"latency": {"enabled": False}, "servers": []} if floor else
           {"latency": {"ports": [8000]}, "quota": {"enabled": True, "interfaces": ["lo"]},
            "admission": {"enabled": True, "mode": "dry-run"}})
agent = Agent(parse(raw, "bench"), HostFS("/"), None)
agent.ctx.detach_on_exit = True
agent.start()
spent = collections.Counter()

def timed(obj, attr, key):
    f = getattr(obj, attr)
    def w(*a, **k):
        t0 = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            spent[key] += time.thread_time() - t0
    setattr(obj, attr, w)

for cap in agent.capabilities:
    for m in ("maintain", "collect", "decide", "apply", "settled"):
        timed(cap, m, f"{cap.name}.{m}")
    if cap.name == "quota":
        timed(cap, "_follow", "  quota: namespace follow (1 s cadence)")
        timed(netns, "serving_namespaces", "    /proc scan and listeners")
        timed(cap.datapath, "attach", "    datapath.attach (netlink)")
        timed(cap.datapath, "heartbeat", "  quota: datapath.heartbeat")
        timed(cap.datapath, "read_changed", "  quota: datapath.read_changed")
for svc in agent.services:
    timed(svc, "collect", f"{svc.name} (service).collect")
for m in ("_sample_gpu", "_reprobe_gpu", "_restate", "_recover"):
    timed(agent, m, f"agent.{m}")
for _ in range(10):
    agent.tick()
    time.sleep(0.1)
spent.clear()
c0, w0, tick = time.process_time(), time.monotonic(), 0.0
try:
    for _ in range(ticks):
        t0 = time.thread_time()
        agent.tick()
        tick += time.thread_time() - t0
        time.sleep(0.1)
finally:
    cpu, wall = time.process_time() - c0, time.monotonic() - w0
    agent.stop()
print(json.dumps({"states": {k: v.state.value for k, v in agent.verdicts.items()},
                  "cpu_pct": 100 * cpu / wall, "tick_us": 1e6 * tick / ticks,
                  "parts": {k: 1e6 * v / ticks for k, v in spent.items()}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--ticks", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    res: dict[str, list[dict]] = {"full": [], "floor": []}
    for _ in range(a.rounds):
        for mode in res:
            r = in_netns(CHILD, os.path.abspath(a.checkout), mode, str(a.ticks))
            res[mode].append(r)
            print(f"{mode}: process {r['cpu_pct']:.2f} % of a core, tick {r['tick_us']:.0f} µs; "
                  f"{ {k: v for k, v in r['states'].items() if v != 'disabled'} }", file=sys.stderr)
    for mode, runs in res.items():
        each = ", ".join(f"{r['cpu_pct']:.2f}" for r in runs)
        print(f"\n{mode}: process CPU {statistics.median(r['cpu_pct'] for r in runs):.2f} % of a core "
              f"(rounds {each}), tick CPU "
              f"{statistics.median(r['tick_us'] for r in runs):.0f} µs\n")
        print("| part | µs per tick (median) | rounds |")
        print("|---|---:|---|")
        parts = {k: [r["parts"].get(k, 0.0) for r in runs] for k in runs[0]["parts"]}
        for k, v in sorted(parts.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"| {k} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} |")


if __name__ == "__main__":
    main()
