"""What attributing process tenants by address (lat_netns) costs the latency probes: BPF run time per connection of
the program that resolves a new connection's tenant (tracepoint mode: inet_sock_set_state; sockops mode:
lat_sockops), with and without the change, in interleaved rounds on the same machine.

Run as root: `python bench/latency_pods_bench.py BEFORE_CHECKOUT AFTER_CHECKOUT [--rounds N] [--conns N]`, e.g. a
`git worktree` of the commit before and this checkout. Each round runs, in a fresh child process per checkout, the
latency capability of that checkout (its BPF) and N short loopback connections (connect, one request, close) to a
watched port, with BPF run statistics on for that moment only. The tenant rules: one CIDR tenant and one process
tenant, and (after) a pod's address in lat_netns, so that a connection takes the longest resolution path (no port
claim, a lookup of its address that misses, then the CIDRs).
Prints a Markdown table for docs/PERFORMANCE.md: ns per run and per connection, median over rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, socket, sys, threading
sys.path.insert(0, sys.argv[1])
from qosagent.capability import AgentContext
from qosagent.config import parse
from qosagent.features import ensure_mounted, probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from qosagent.ebpf import libbpf

mode, conns = sys.argv[2], int(sys.argv[3])
srv = socket.create_server(("127.0.0.1", 0), backlog=1024)
port = srv.getsockname()[1]

def serve():
    while True:
        try:
            c, _ = srv.accept()
        except OSError:
            return
        c.recv(256)
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        c.close()

threading.Thread(target=serve, daemon=True).start()
fs = HostFS("/")
ensure_mounted(fs)
cfg = parse({"tenants": [{"name": "net2", "tier": "gold", "match": {"cidrs": ["127.0.0.2/32"]}},
                         {"name": "pod", "tier": "gold", "match": {"process": "no-such-process"}}],
             "latency": {"mode": mode, "ports": [port], "runqueue": {"enabled": False}}}, "bench")
cap = Latency(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu("bench")))
cap.probe(probe(fs))
cap.start()
if cap.dp.prog.has_map("lat_netns"):
    # A pod's address in the map, not the bench's: every connection looks it up and misses (the longest path).
    m, conf = cap.dp.prog.map("lat_netns"), cap.dp.prog.map("lat_netns_conf")
    m.update(bytes(10) + b"\xff\xff" + bytes([198, 18, 1, 1]) + port.to_bytes(2, sys.byteorder) + bytes(2),
             m.value(tenant=1))
    conf.update(0, conf.value(entries=1))
name = "lat_sockops" if mode == "sockops" else "tracepoint__sock__inet_sock_set_state"
fd = cap.dp.prog.fd(name)
stats = libbpf.enable_stats()
i0 = libbpf._ProgInfo(); libbpf._info(fd, i0)
for _ in range(conns):
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        c.recv(256)
i1 = libbpf._ProgInfo(); libbpf._info(fd, i1)
os.close(stats)
cap.stop()
print(json.dumps({"runs": i1.run_cnt - i0.run_cnt, "ns": i1.run_time_ns - i0.run_time_ns}))
"""


def one(checkout: str, mode: str, conns: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, checkout, mode, str(conns)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--conns", type=int, default=2000)
    p.add_argument("--modes", default="tracepoint,sockops")
    a = p.parse_args()
    print("| mode | code | ns per run (median) | runs per connection | ns per connection | after ÷ before |")
    print("|---|---|---|---|---|---|")
    for mode in a.modes.split(","):
        got: dict[str, list[dict[str, int]]] = {"before": [], "after": []}
        for _ in range(a.rounds):
            for which in ("before", "after"):
                got[which].append(one(getattr(a, which), mode, a.conns))
        per_conn = {w: statistics.median(r["ns"] / a.conns for r in rs) for w, rs in got.items()}
        for w, rs in got.items():
            print(f"| {mode} | {w} | {statistics.median(r['ns'] / r['runs'] for r in rs):.0f} | "
                  f"{statistics.median(r['runs'] / a.conns for r in rs):.1f} | {per_conn[w]:.0f} | "
                  + (f"{per_conn['after'] / per_conn['before']:.3f} |" if w == "after" else "|"))


if __name__ == "__main__":
    main()
