"""Many tenants on a node: the agent's tick CPU, its idle CPU and RSS for 10, 100, 1,000 and 4,000 configured tenants
with 1 % and 100 % of them active, beside the 10-tenant baseline taken in the same run; and the time to load, validate
and sync a 4,000-tenant config, and what a reload of one tenant writes.

Run as root from the checkout: `python -m bench.scale_tenants [--tenants 10,100,1000,4000] [--ticks 60]`. Each case
runs in a child process of its own, in a network namespace of its own (quota's filter on its lo, its pins under a
bpffs directory of its own, both removed at the end): the whole Agent.tick() with quota, latency and admission
(dry-run) on real BPF, tenants matched by client network, as an inference provider's API keys would be.

"Active" is what the kernel's programs would do for a request of each active tenant before every tick: its latency
rows, counters and generation, its quota counters and generation (bumped in the maps as the programs bump them, by
this bench, outside the timed tick). 4,000 tenants each sending between two 100 ms ticks would be 40,000 requests a
second, more than a 2-CPU host can serve and time; what the tick costs depends on which rows changed, not on how.

Prints Markdown tables for docs/PERFORMANCE.md: median tick CPU (thread CPU time of Agent.tick), its ratio to the
10-tenant 1 % case, the process's CPU over the idle run as a share of one core at the 100 ms interval (every thread:
the tick's, the servers' reader, the pods' lister), RSS, and rows read per tick (latency + quota).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench.tick_cpu import in_netns

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from qosagent.config import parse
from qosagent.daemon import Agent
from qosagent.gpu.backend import NoGpu
from qosagent.hist import bucket_index
from qosagent.hostfs import HostFS
from qosagent.latency import bpfmaps as bm
from qosagent.latency.capability import Latency
from qosagent.quota.capability import Quota

n, active, ticks, pins = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tiers = ("gold", "silver", "bronze")
cfg = parse({"interval": "100ms", "metrics": {"enabled": False},
             "tenants": [{"name": f"t{i}", "tier": tiers[i % 3], "match": {"cidrs": [f"10.{i // 250}.{i % 250}.0/24"]},
                          "quota": {"rps": 1000, "burst": 100}} for i in range(n)],
             "latency": {"ports": [18000]},
             "quota": {"enabled": True, "interfaces": ["lo"]},
             "admission": {"enabled": True, "mode": "dry-run"},
             "bpf": {"pin_root": pins}}, "bench")
agent = Agent(cfg, HostFS("/"), None, gpu=NoGpu("bench"))
agent.ctx.detach_on_exit = True
agent.start()
states = {k: v.state.value for k, v in agent.verdicts.items()}
lat = next(c for c in agent.capabilities if isinstance(c, Latency))
quota = next(c for c in agent.capabilities if isinstance(c, Quota))
lm = {name: lat.dp.map(name) for name in ("lat_hist", "lat_counters", "lat_gen")}
qm = {name: quota.datapath.maps[name] for name in ("quota_counters",)}
qgen = quota.datapath.program.map("quota_gen")
lat_slots = [lat.dp.slots[t] for t in sorted(lat.dp.slots) if t][:active]
quota_slots = [quota.datapath.slots[t] for t in sorted(quota.datapath.slots)][:active]
step = 0


def requests():
    # One request of each active tenant, as the programs record it: a response time (and headers) of 20-40 ms,
    # a request started, an admitted request, each slot's generation after its change.
    global step
    step += 1
    ns = 20_000_000 + (step % 20) * 1_000_000
    b = bucket_index(ns)
    for s in lat_slots:
        for kind in (bm.KIND_HEADERS, bm.KIND_RESPONSE):
            row = lm["lat_hist"].lookup(bm.KINDS * s + kind)
            row.count[b] += 1
            row.sum_ns += ns
            lm["lat_hist"].update(bm.KINDS * s + kind, row)
        c = lm["lat_counters"].lookup(s)
        c[0].n[bm.C_STARTED] += 1
        lm["lat_counters"].update(s, c)
        g = lm["lat_gen"].lookup(s)
        g.n += 1
        lm["lat_gen"].update(s, g)
    for s in quota_slots:
        c = qm["quota_counters"].lookup(s)
        c[0].req_admitted += 1
        qm["quota_counters"].update(s, c)
        g = qgen.lookup(s)
        g.n += 1
        qgen.update(s, g)


def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])


try:
    for _ in range(10):
        requests()
        agent.tick()
        time.sleep(0.1)
    cpu, rows = [], []
    p0, w0 = time.process_time(), time.monotonic()
    feed = 0.0
    for _ in range(ticks):
        f0 = time.process_time()
        requests()
        feed += time.process_time() - f0
        t0 = time.thread_time()
        snap = agent.tick()
        cpu.append(time.thread_time() - t0)
        rows.append(snap.part("latency").rows_read + snap.part("quota").rows_read)
        time.sleep(max(0.0, 0.1 - (time.thread_time() - t0)))
    proc = (time.process_time() - p0 - feed) / (time.monotonic() - w0)
    rss = rss_kb()
finally:
    agent.stop()
print(json.dumps({"cpu": cpu, "states": states, "proc": proc, "rss_kb": rss, "rows": rows}))
"""

CONFIG = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import yaml
from qosagent.config import parse_text
from qosagent.ebpf import maps
from qosagent.hostfs import HostFS
from qosagent.latency.datapath import Datapath as LatencyDatapath
from qosagent.latency.model import Plan
from qosagent.quota.datapath import Datapath as QuotaDatapath
from qosagent.quota.rules import baseline_buckets

n, pins = int(sys.argv[2]), sys.argv[3]


def text(moved=None):
    tenants = []
    for i in range(n):
        match = {"cidrs": [f"10.{i // 250}.{i % 250}.0/24" if i != moved else "192.168.99.0/24"]}
        if i % 4 == 0:
            match["header"] = {"name": "x-api-key", "value": f"key-{i}"}
        if i % 10 == 0:
            match["ports"] = [20000 + i]
        tenants.append({"name": f"t{i}", "tier": "silver", "match": match, "quota": {"rps": 100 + i, "burst": 10}})
    return yaml.safe_dump({"tenants": tenants, "latency": {"ports": [18000]},
                           "quota": {"enabled": True, "interfaces": ["lo"]}, "bpf": {"pin_root": pins}})


first, again = text(), text(moved=7)
t0 = time.perf_counter()
cfg = parse_text(first, "bench")
t_parse = time.perf_counter() - t0
quota = QuotaDatapath(cfg)
lat = LatencyDatapath.load(cfg, Plan("tracepoint", arrival=False, egress=False, runq=False), HostFS("/"))
try:
    t0 = time.perf_counter()
    quota.write_config(cfg, baseline_buckets(cfg))
    lat.write(lat.plan(cfg))
    t_sync = time.perf_counter() - t0
    before = maps.writes.copy()
    t0 = time.perf_counter()
    new = parse_text(again, "bench")
    quota.write_config(new, baseline_buckets(new))
    lat.write(lat.plan(new))
    t_reload = time.perf_counter() - t0
    reload_writes = dict(maps.writes - before)
finally:
    lat.close()
    quota.close()
print(json.dumps({"parse": t_parse, "sync": t_sync, "reload": t_reload, "reload_writes": reload_writes}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", default="10,100,1000,4000")
    ap.add_argument("--ticks", type=int, default=60)
    ap.add_argument("--checkout", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()
    counts = [int(x) for x in a.tenants.split(",")]
    results = {}
    for n in counts:
        for share in (0.01, 1.0):
            active = max(1, round(n * share))
            res = in_netns(CHILD, a.checkout, str(n), str(active), str(a.ticks), timeout=900)
            print(f"n={n} active={active}: {res['states']}", file=sys.stderr)
            results[(n, share)] = res
    base = statistics.median(results[(counts[0], 0.01)]["cpu"])
    print("| tenants | active | tick CPU median (µs) | p95 (µs) | x baseline | process CPU, % of a core | RSS (MB) | "
          "rows read per tick |")
    print("|---|---|---|---|---|---|---|---|")
    for (n, share), r in results.items():
        cpu = sorted(r["cpu"])
        med, p95 = statistics.median(cpu), cpu[int(len(cpu) * 0.95)]
        print(f"| {n} | {max(1, round(n * share))} ({share:.0%}) | {med * 1e6:.0f} | {p95 * 1e6:.0f} "
              f"| {med / base:.2f} | {r['proc'] * 100:.1f} | {r['rss_kb'] / 1024:.0f} | "
              f"{statistics.median(r['rows']):.0f} |")
    c = in_netns(CONFIG, a.checkout, "4000", timeout=900)
    print(f"\n4,000 tenants: parse and validate {c['parse'] * 1e3:.0f} ms, first sync of both programs' maps "
          f"{c['sync'] * 1e3:.0f} ms (load+sync {(c['parse'] + c['sync']) * 1e3:.0f} ms); a reload moving one tenant's "
          f"network {c['reload'] * 1e3:.0f} ms, writing {c['reload_writes']}")


if __name__ == "__main__":
    main()
