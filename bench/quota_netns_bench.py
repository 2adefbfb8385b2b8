"""Where to classify requests into a pod's network namespace: on the egress of the host-side veth (what the agent
does) or on the ingress of the pod's own interface. nginx in a "pod" namespace behind a veth pair, wrk from the
"node" namespace; HTTP throughput with no classifier, with it on each hook (a process tenant, resolved through
quota_netns, with a quota that never runs dry), interleaved rounds, ratios against the same round's baseline.

Run as root from the checkout: python bench/quota_netns_bench.py. Prints a Markdown section for
docs/PERFORMANCE.md ("Quota in serving namespaces")."""

from __future__ import annotations

import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qosagent.config import parse  # noqa: E402
from qosagent.quota import datapath as dp  # noqa: E402
from qosagent.quota.rules import baseline_buckets  # noqa: E402
from qosagent.tenants import tenant_id  # noqa: E402

ROUNDS, SECONDS = 5, 4
NGINX_CONF = """worker_processes 1; daemon off; pid {tmp}/nginx.pid; error_log {tmp}/error.log;
events {{ worker_connections 1024; }}
http {{ access_log off; client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp};
  uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
  server {{ listen 198.18.9.1:8000; location / {{ return 200 "ok"; }} }} }}
"""


def sh(*a: str) -> str:
    return subprocess.run(a, check=True, capture_output=True, text=True).stdout


def ifindex(ns: str, dev: str) -> int:
    return int(sh("ip", "-n", ns, "-o", "link", "show", dev).split(":", 1)[0])


def main() -> None:
    tag = uuid.uuid4().hex[:6]
    node, pod = f"qa-nsb-{tag}-n", f"qa-nsb-{tag}-p"
    tmp = Path(tempfile.mkdtemp(prefix="qa-nsb-"))
    pin_root = f"/sys/fs/bpf/qosagent-bench-{tag}"
    procs: list[subprocess.Popen] = []
    d = None
    try:
        for ns in (node, pod):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", node, "link", "add", "pa", "type", "veth", "peer", "name", "eth0", "netns", pod)
        sh("ip", "-n", node, "addr", "add", "198.18.9.254/24", "dev", "pa")
        sh("ip", "-n", pod, "addr", "add", "198.18.9.1/24", "dev", "eth0")
        for ns, dev in ((node, "pa"), (pod, "eth0")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        (tmp / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp))
        procs.append(subprocess.Popen(["ip", "netns", "exec", pod, "nginx", "-c", str(tmp / "nginx.conf")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
        cfg = parse({"bpf": {"pin_root": pin_root}, "latency": {"enabled": False, "ports": [8000]},
                     "quota": {"enabled": True},
                     "tenants": [{"name": "pod", "tier": "gold", "match": {"process": "nginx"},
                                  "quota": {"rps": 1e9, "burst": 1000000}}]}, "bench")
        d = dp.Datapath(cfg)
        d.write_config(cfg, baseline_buckets(cfg))
        tid = tenant_id("pod")
        d.set_netns({(ifindex(node, "pa"), 8000): tid, (ifindex(pod, "eth0"), 8000): tid})
        prog = f"{dp.pin_dir(cfg)}/{dp.PROG_PIN}"
        hooks = {"host-side veth, egress": (node, "pa", "egress"), "pod's interface, ingress": (pod, "eth0", "ingress")}

        def wrk() -> float:
            out = sh("ip", "netns", "exec", node, "wrk", "-t1", "-c16", f"-d{SECONDS}s", "http://198.18.9.1:8000/")
            return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

        ratios: dict[str, list[float]] = {k: [] for k in hooks}
        base: list[float] = []
        for _ in range(ROUNDS):
            b = wrk()
            base.append(b)
            for name, (ns, dev, hook) in hooks.items():
                # nsenter, not `tc -n`: that remounts /sys, hiding the pinned program.
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "clsact")
                sh("nsenter", f"--net=/run/netns/{ns}", "tc", "filter", "add", "dev", dev, hook, "prio", "3082",
                   "handle", "0x51a", "bpf", "da", "object-pinned", prog)
                ratios[name].append(wrk() / b)
                sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "clsact")
        admitted = d.read().counts[tid][0]
        print("## Quota in serving namespaces\n")
        print(f"nginx in a pod namespace behind a veth pair, `wrk -t1 -c16` from the node namespace, {ROUNDS} "
              f"interleaved rounds of {SECONDS} s; {platform.release()}, {len(base)} baselines median "
              f"{statistics.median(base):.0f} req/s; {admitted} requests went through the pod's tenant.\n")
        print("| classifier on | throughput vs none (median) | range |")
        print("|---|---|---|")
        for name, r in ratios.items():
            print(f"| {name} | {statistics.median(r):.3f} | {min(r):.3f}–{max(r):.3f} |")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        for ns in (node, pod):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if d is not None:
            d.close()
        shutil.rmtree(pin_root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
