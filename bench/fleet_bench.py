"""Fleet quotas against a real etcd (started here, on loopback, with a data dir of its own):

1. The allocator's CPU for NODES x TENANTS, the reports written straight into etcd by simulated reporters:
   process CPU time of Allocator.round() (list the reports, read and decode those written since the last round,
   re-split what moved, write the grants that changed and the round record in fenced transactions), one round
   per 1 s report interval, as a fraction of one core (target: under 10 %); with demand holding still and with
   every report rewritten before every round.
2. Convergence after a demand shift and the steady-state admitted rate against the quota, with the real
   allocator and one real Reporter per simulated node (each node admits min(demand, share), and reports that as
   demand plus what it dropped, at most its share again: clients that were refused back off): seconds from the
   shift until every node enforces its new share for good (target: within two report intervals plus one lease
   renewal), the allocator's own convergence_seconds, and the sum of admitted over the quota in steady state
   (target: +-5 %).

    python bench/fleet_bench.py [--nodes 1000 --tenants 100 --rounds 5] [--sim-nodes 5 --interval 0.5]
        [--shifts 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qosagent.config import parse  # noqa: E402
from qosagent.fleet import records  # noqa: E402
from qosagent.fleet.agent import Reporter  # noqa: E402
from qosagent.fleet.allocator import Allocator  # noqa: E402
from qosagent.fleet.etcd import Etcd, EtcdError  # noqa: E402
from qosagent.fleet.model import shares  # noqa: E402
from qosagent.fleet.quotas import fleet_quotas  # noqa: E402
from qosagent.fleet.records import Want  # noqa: E402

PORT = 23791


def start_etcd(tmp: Path) -> subprocess.Popen:
    peer = f"http://127.0.0.1:{PORT + 1}"
    p = subprocess.Popen(["etcd", "--name", "bench", "--data-dir", str(tmp / "etcd"), "--listen-client-urls",
                          f"http://127.0.0.1:{PORT}", "--advertise-client-urls", f"http://127.0.0.1:{PORT}",
                          "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster",
                          f"bench={peer}", "--log-level", "warn", "--quota-backend-bytes", str(4 << 30)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    e = Etcd([f"http://127.0.0.1:{PORT}"])
    for _ in range(100):
        try:
            e.get("/")
            return p
        except EtcdError:
            time.sleep(0.1)
    raise SystemExit("etcd did not start")


def config(tenants: int, interval: float, lease: float, prefix: str, nodes: int):  # type: ignore[no-untyped-def]
    return parse({"quota": {"enabled": True},
                  "fleet": {"enabled": True, "endpoints": [f"http://127.0.0.1:{PORT}"], "prefix": prefix,
                            "report_interval": f"{interval}s", "lease": f"{lease}s", "expected_nodes": nodes},
                  "tenants": [{"name": f"t{i}", "tier": "gold", "match": {"ports": [10000 + i]},
                               "quota": {"fleet_rps": 1000.0 * (1 + i % 7)}} for i in range(tenants)]}, "bench")


def round_cpu(nodes: int, tenants: int, rounds: int) -> None:
    """Rounds with every report as it was (demand holding still: nothing to decode, re-split or rewrite but the
    round record), then rounds before which every reporter wrote a new report (every demand moving: every report
    decoded, every tenant re-split, every grant rewritten)."""
    cfg = config(tenants, 1.0, 30.0, "/bench-cpu", nodes)  # a lease that outlasts writing 1,000 reports here
    etcd = Etcd(cfg.fleet.endpoints, timeout=10)
    lease = etcd.grant(600)
    names = [f"t{i}" for i in range(tenants)]

    def report(k: int) -> None:  # what `nodes` reporters write, demand moved by k
        for n in range(nodes):
            wants = {t: Want(float((n * 7 + i * 13 + k * 31) % 500), 1000.0 / nodes) for i, t in enumerate(names)}
            etcd.put(records.nodes_prefix(cfg.fleet.prefix) + f"node-{n}",
                     records.encode_report(f"node-{n}", wants), lease)

    report(0)
    a = Allocator(cfg, Etcd(cfg.fleet.endpoints, timeout=10), me="bench")
    a.round()  # campaigns; moving its election back one lease ends the wait a new leader keeps
    a.leading_since -= cfg.fleet.lease
    a.round()
    for what, k in (("demand holding still", None), ("every report rewritten before every round", 1)):
        cpu, wall = [], []
        for r in range(rounds):
            if k is not None:
                report(k + r)
            t0, w0 = time.process_time(), time.perf_counter()
            a.round()
            cpu.append(time.process_time() - t0)
            wall.append(time.perf_counter() - w0)
        assert a.nodes == nodes and a.stats.errors.get("etcd", 0) == 0 and a.is_leader, a.stats
        med = statistics.median(cpu)
        print(f"| allocator round, {nodes} nodes x {tenants} tenants, {what} | CPU {med * 1e3:.0f} ms (median of "
              f"{rounds}; min {min(cpu) * 1e3:.0f}, max {max(cpu) * 1e3:.0f}), wall "
              f"{statistics.median(wall) * 1e3:.0f} ms | {med * 100:.1f} % of one core at a 1 s interval "
              "(target < 10 %) |")
    a.resign()
    etcd.revoke(lease)


def convergence(nodes: int, interval: float, prefix: str) -> None:
    lease = 4 * interval
    cfg = config(1, interval, lease, prefix, nodes)
    quota = fleet_quotas(cfg)
    q = quota["t0"].rps
    alloc = Allocator(cfg, Etcd(cfg.fleet.endpoints))
    threading.Thread(target=alloc.run, daemon=True).start()
    reps = {}
    for i in range(nodes):
        f = cfg.fleet.model_copy(update={"node": f"sim-{i}"})
        reps[f"sim-{i}"] = r = Reporter(f, Etcd(f.endpoints))
        r.start()
    phase = 4 * lease + 8 * interval

    def run(demand: dict[str, float]) -> list[tuple[float, float, list[float]]]:
        """Each node admits min(demand, share) and reports that plus what it dropped; (time, fleet admitted, each
        node's share)."""
        out = []
        end = time.monotonic() + phase
        while time.monotonic() < end:
            now = time.monotonic()
            total = 0.0
            held = []
            for n, r in reps.items():
                s = shares(quota, r.seen(), now, lease, cfg.fleet.share_when_unleased, 0.05)["t0"]
                adm = min(demand[n], s.node_rps)
                total += adm
                held.append(s.node_rps)
                r.offer({"t0": Want(adm + min(demand[n] - adm, s.node_rps), s.node_rps)})
            out.append((now, total, held))
            time.sleep(0.05)
        return out

    def steady(log: list[tuple[float, float, list[float]]]) -> list[float]:
        return [t for ts, t, _ in log if ts > log[-1][0] - 2 * lease]

    def settled(log: list[tuple[float, float, list[float]]]) -> float:
        """Seconds from the shift until every node enforces its final share (within 5 % of the quota) for good."""
        final = log[-1][2]
        at = log[-1][0]
        for ts, _, held in reversed(log):
            if any(abs(h - f) > 0.05 * q for h, f in zip(held, final)):
                break
            at = ts
        return at - log[0][0]

    before = run({n: (3 * q if n == "sim-0" else 0.0) for n in reps})
    alloc.stats.convergence.clear()
    after = run({n: (0.0 if n == "sim-0" else 3 * q / (nodes - 1)) for n in reps})
    ratio = statistics.mean(steady(before) + steady(after)) / q
    conv = alloc.stats.convergence.get("t0")
    took = settled(after)
    print(f"| demand shift, {nodes} simulated nodes, report interval {interval:g} s, lease {lease:g} s | "
          f"every node enforcing its new share {took:.2f} s after the demand moved = {took / interval:.1f} report "
          f"intervals; the allocator's convergence_seconds {'-' if conv is None else f'{conv:.2f}'} s = "
          f"{'-' if conv is None else f'{conv / interval:.1f}'} (target <= 3: two intervals plus one renewal) | "
          f"steady-state admitted / quota = {ratio:.3f} (target 0.95-1.05) |")
    alloc.stop()
    alloc.resign()
    for r in reps.values():
        r.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--tenants", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shifts", type=int, default=3)
    p.add_argument("--sim-nodes", type=int, default=5)
    p.add_argument("--interval", type=float, default=0.5)
    a = p.parse_args()
    if shutil.which("etcd") is None:
        raise SystemExit("needs etcd (Debian's etcd-server; QOSAGENT_SETUP_TEST=1 make setup)")
    tmp = Path(tempfile.mkdtemp(prefix="qosagent-fleet-bench-"))
    proc = start_etcd(tmp)
    try:
        print("| what | measured | against the target |\n|---|---|---|")
        round_cpu(a.nodes, a.tenants, a.rounds)
        for i in range(a.shifts):
            convergence(a.sim_nodes, a.interval, f"/bench-conv-{i}")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
