"""Resources' loop against a CPU hog: gold's latency with a flooded CPU-bound bronze server beside it on the same CPU,
resources in dry-run (off) and in enforce (on), against gold alone; the three interleaved in every round, one run.
Run as root from the checkout: `python bench/resources_bench.py [--rounds N] [--seconds S]`. Prints a Markdown
section for docs/PERFORMANCE.md.

The servers are those of tests/integration/test_resources_loop.py: gold one process burning 10 ms of CPU per
request, bronze four burning 50 ms, each in a cgroup of its own with equal CPU weights, both pinned to CPU 1, in a
network namespace of their own. Gold's clients: one connection at a time, 20 ms apart; bronze's flood: eight
connections back to back. Each request is answered in one write, so its time to first byte is its time to first
token (measured by the client). Each phase runs an agent of its own (latency and resources, nothing else: no
request is dropped, CPU is the only lever); its run-queue histograms give gold's server's threads apart (its tier's
row) and both servers' (every tier's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import netns  # noqa: E402
from tests.integration.resources_lab import Lab, cgroup_lab, free_port, run_in  # noqa: E402
from testkit.agent import AgentProcess, agent_argv, agent_env  # noqa: E402

SERVER = str(REPO / "tests/integration/resources_load.py")
GOLD_SLO_MS = 20.0
PHASES = ("alone", "off", "on")
AGENT_CONF = """\
interval: 100ms
state_dir: {state}
metrics: {{enabled: false}}
status: {{socket: {sock}}}
bpf: {{pin_root: {pins}}}
servers: []
tiers:
  gold:   {{slo_p99: {slo:g}ms, weight: 10, resources: {{cpu_weight: 100}}}}
  bronze: {{slo_p99: 5s, weight: 1, resources: {{}}}}
tenants:
  - {{name: gold-app, tier: gold, match: {{ports: [{gp}]}}}}
  - {{name: bronze-app, tier: bronze, match: {{ports: [{bp}]}}}}
latency: {{enabled: true, window: 1s}}
admission: {{signal: response, quantile: 0.95}}
resources:
  enabled: true
  mode: {mode}
  reconcile_interval: 500ms
  suppress: {{floor_cpus: 0.1, factor: 0.6, every: 500ms, release_step: 1.0, release_every: 500ms,
              healthy_ticks: 10}}
"""


def clients(ns: str, port: int, threads: int, pause_ms: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    return run_in(ns, [sys.executable, "-m", "testkit.load", "client", "127.0.0.1", str(port), "127.0.0.1",
                      str(threads), str(pause_ms), str(seconds), "5", str(out)], cwd=str(REPO))


def phase(ns: str, tmp: Path, pins: str, name: str, n: int, gp: int, bp: int, seconds: float) -> dict:
    """One phase: an agent of its own (the build pinned under `pins` by the first, reused by the rest), gold's
    clients for `seconds`, bronze flooded throughout unless alone."""
    d = tmp / f"{name}-{n}"
    d.mkdir()
    sock = str(d / "s.sock")
    cfg = d / "qosagent.yaml"
    cfg.write_text(AGENT_CONF.format(state=d / "state", sock=sock, pins=pins, slo=GOLD_SLO_MS, gp=gp, bp=bp,
                                     mode="enforce" if name == "on" else "dry-run"))
    agent = AgentProcess(cfg, sock, d / "agent.log", prefix=["nsenter", f"--net=/run/netns/{ns}"])
    try:
        caps = agent.start(timeout=120)["capabilities"]
        assert caps["latency"]["state"] == "active" and caps["resources"]["state"] == "active", caps
        flood = clients(ns, bp, 8, 0, seconds + 1, d / "bronze.json") if name != "alone" else None
        time.sleep(1)  # the flood takes the CPU before gold's first request
        gold = clients(ns, gp, 1, 20, seconds, d / "gold.json")
        assert gold.wait(seconds + 60) == 0
        st = agent.status(decisions=True)
        if flood is not None:
            assert flood.wait(60) == 0
    finally:
        agent.stop()
        agent.kill()
    ms = [r[1] for r in json.loads((d / "gold.json").read_text()) if r[2]]  # testkit.load writes ms
    cuts = [x for x in st.get("decisions", []) if x["capability"] == "resources" and x["action"] == "cut"]
    lat = st.get("latency", {})
    rq = lat.get("runqueue_total") or {}
    gold_rq = (lat.get("runqueue_tiers_total") or {}).get("gold") or {}
    if ms and not gold_rq.get("count"):
        # Gold's server woke for every request: no waits in its tier's row means it was never counted there (noted
        # in another row, or not followed), and its column would say nothing true.
        raise SystemExit(f"phase {name}, round {n}: gold served {len(ms)} requests but its tier's run-queue row has "
                         f"no waits (rows: {sorted(lat.get('runqueue_tiers_total') or {})})")
    return {"ms": ms, "cuts": len(cuts), "runq_p99_ms": (rq.get("p99") or 0) * 1000,
            "gold_runq_p99_ms": gold_rq["p99"] * 1000 if gold_rq.get("p99") is not None else None,
            "gold_runq_waits": gold_rq.get("count", 0)}


@contextlib.contextmanager
def detached(pins: str) -> Iterator[None]:
    """`qosagent detach` of the pinned build at the end: the host is left as it was."""
    try:
        yield
    finally:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
            cfg.write(f"bpf: {{pin_root: {pins}}}\nlatency: {{enabled: true}}\n")
            cfg.flush()
            subprocess.run(agent_argv("detach", "--config", cfg.name), env=agent_env(), capture_output=True,
                           timeout=60, check=False)


def ms_or_na(v: float | None, fmt: str = ".2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def median_or_none(xs: list[float | None]) -> float | None:
    have = [x for x in xs if x is not None]
    return statistics.median(have) if have else None


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000, method="inclusive")[round(q * 1000) - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0)
    args = ap.parse_args()
    gp, bp = free_port(), free_port()
    got: dict[str, list[dict]] = {p: [] for p in PHASES}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    pins = f"/sys/fs/bpf/qosagent-bench-{secrets.token_hex(4)}"
    with cgroup_lab() as lab, netns("resbench") as ns, tempfile.TemporaryDirectory() as tmp, detached(pins):
        lab_: Lab = lab
        gold, bronze = lab_.cgroup("gold"), lab_.cgroup("bronze")
        for port, path, n, ms in ((gp, gold, 1, 10), (bp, bronze, 4, 50)):
            p = run_in(ns, [sys.executable, SERVER, str(port), str(n), str(ms)],
                      [f"{lab_.dir(c, path)}/cgroup.procs" for c in ("cpu", "memory")], cpu=1,
                      stdout=subprocess.PIPE)
            lab_.procs.append(p)  # type: ignore[arg-type]
            assert p.stdout is not None and p.stdout.readline().strip() == b"listening"
        for r in range(args.rounds):
            order = PHASES[r % 3:] + PHASES[:r % 3]  # interleaved: each phase in every position
            for name in order:
                got[name].append(phase(ns, Path(tmp), pins, name, r, gp, bp, args.seconds))
                print(f"round {r} {name}: p99 {pct(got[name][-1]['ms'], 0.99):.1f} ms", file=sys.stderr)
    pooled = {p: [x for run in got[p] for x in run["ms"]] for p in PHASES}
    p50 = {p: statistics.median(pooled[p]) for p in PHASES}
    p99 = {p: pct(pooled[p], 0.99) for p in PHASES}
    print(f"### Gold beside a CPU hog, resources off and on (bench/resources_bench.py, {started}, "
          f"{os.cpu_count()} CPUs shared, kernel {platform.release()})\n")
    print(f"{args.rounds} rounds x {args.seconds:g} s per phase, interleaved; gold's SLO {GOLD_SLO_MS:g} ms (p95 of "
          "`response`).\n")
    print("| phase | gold requests | TTFT p50 ms | TTFT p99 ms | p99 / alone | run-queue p99 ms, gold's server "
          "(agent, its tier's row) | run-queue p99 ms, both servers | loop's cuts (would, in dry-run) |")
    print("|---|---|---|---|---|---|---|---|")
    for p in PHASES:
        rq = statistics.median(run["runq_p99_ms"] for run in got[p])
        gold_rq = median_or_none([run["gold_runq_p99_ms"] for run in got[p]])
        print(f"| {p} | {len(pooled[p])} | {p50[p]:.1f} | {p99[p]:.1f} | {p99[p] / p99['alone']:.2f} | "
              f"{ms_or_na(gold_rq)} | {rq:.1f} | {sum(run['cuts'] for run in got[p])} |")
    print(f"\nOn against off: p99 {p99['on'] / p99['off']:.2f}x, p50 {p50['on'] / p50['off']:.2f}x. p99 / alone per "
          "round, off: " + ", ".join(f"{pct(o['ms'], 0.99) / pct(a['ms'], 0.99):.2f}" for o, a in
                                     zip(got["off"], got["alone"]))
          + "; on: " + ", ".join(f"{pct(o['ms'], 0.99) / pct(a['ms'], 0.99):.2f}" for o, a in
                                 zip(got["on"], got["alone"])) + ".")
    print("\nGold's own run-queue p99 per round (ms, waits): " + "; ".join(
        f"{p} " + ", ".join(f"{ms_or_na(run['gold_runq_p99_ms'])} ({run['gold_runq_waits']})" for run in got[p])
        for p in PHASES) + ".")


if __name__ == "__main__":
    main()
