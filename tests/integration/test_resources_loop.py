"""The loop end to end: a gold server and a CPU-bound bronze server on the same CPU, in cgroups of the test's own,
with equal CPU weights (so only the loop protects gold); gold's clients at a steady rate, bronze flooded. With
resources, quota and admission enforcing, bronze loses CPU (its cfs quota) before admission drops any of its
requests, and gets it back when the flood ends. The agent runs in a network namespace of the test's own
(nsenter --net: the host's cgroup and bpffs mounts stay visible), traffic on that namespace's lo."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from qosagent.status import NoAgent, request
from tests.conftest import netns, require
from tests.integration.resources_lab import Lab, cgroup_lab, run_in
from testkit.agent import AgentProcess, agent_argv, agent_env

HERE = Path(__file__).parent
LOAD, SERVER = str(HERE / "admission_load.py"), str(HERE / "resources_load.py")
GOLD_SLO_MS = 20.0


@pytest.fixture
def lab(root: None) -> Iterator[Lab]:
    with cgroup_lab() as lab:
        yield lab


def status(sock: str) -> dict:
    try:
        return request(sock, {"cmd": "status", "decisions": True}, timeout=5)
    except (NoAgent, OSError):
        return {}


def test_bronze_loses_cpu_before_requests_and_gets_it_back(tmp_path, lab: Lab) -> None:
    require(len(os.sched_getaffinity(0)) >= 2, "needs two CPUs")
    require(lab.layout.versions["cpu"] is not None, "cpu controller")
    gp, bp = 20000 + secrets.randbelow(10000), 30000 + secrets.randbelow(10000)
    gold, bronze = lab.cgroup("gold"), lab.cgroup("bronze")
    quota_file = "cpu.max" if lab.layout.versions["cpu"] == "v2" else "cpu.cfs_quota_us"
    before = lab.read("cpu", bronze, quota_file)
    pin_root = f"/sys/fs/bpf/qosagent-test-{secrets.token_hex(4)}"
    sock = str(tmp_path / "status.sock")
    cfg = tmp_path / "qosagent.yaml"
    cfg.write_text(f"""
interval: 100ms
state_dir: {tmp_path / 'state'}
metrics: {{enabled: false}}
status: {{socket: {sock}}}
bpf: {{pin_root: {pin_root}}}
servers: []
tiers:
  gold:   {{slo_p99: {GOLD_SLO_MS:g}ms, weight: 10, resources: {{cpu_weight: 100}}}}
  bronze: {{slo_p99: 5s, weight: 1, quota: {{rps: 2000, burst: 200}}, resources: {{}}}}
tenants:
  - {{name: gold-app, tier: gold, match: {{ports: [{gp}]}}}}
  - {{name: bronze-app, tier: bronze, match: {{ports: [{bp}]}}}}
latency: {{enabled: true, window: 1s}}
quota: {{enabled: true, interfaces: [lo]}}
admission: {{enabled: true, mode: enforce, signal: response, quantile: 0.95, breach_ticks: 3}}
resources:
  enabled: true
  mode: enforce
  reconcile_interval: 500ms
  suppress: {{floor_cpus: 0.1, factor: 0.6, every: 500ms, release_step: 1.0, release_every: 500ms,
              healthy_ticks: 10}}
""")
    with netns("resources") as ns:
        procs: list[subprocess.Popen[bytes]] = []
        agent = AgentProcess(cfg, sock, tmp_path / "agent.log",
                             prefix=["nsenter", f"--net=/run/netns/{ns}"])
        try:
            # Both servers on CPU 1: gold one process burning 10 ms a request (alone ~10 ms, under the flood at half
            # the CPU >= 20 ms), bronze four burning 50 ms.
            for port, path, n, ms in ((gp, gold, 1, 10), (bp, bronze, 4, 50)):
                p = run_in(ns, [sys.executable, SERVER, str(port), str(n), str(ms)],
                           [f"{lab.dir(c, path)}/cgroup.procs" for c in ("cpu", "memory")], cpu=1,
                           stdout=subprocess.PIPE)
                procs.append(p)
                assert p.stdout is not None and p.stdout.readline().strip() == b"listening"
            caps = agent.start(timeout=120)["capabilities"]
            # Without latency no verdict is judged and the loop has nothing to answer (a venv without bcc did that).
            assert all(caps[c]["state"] == "active" for c in ("latency", "quota", "admission", "resources")), caps
            t0 = time.monotonic()
            gold_out, bronze_out = tmp_path / "gold.json", tmp_path / "bronze.json"
            gold_clients = run_in(ns, [sys.executable, LOAD, "client", "127.0.0.1", str(gp), "127.0.0.1", "1",
                                       "20", "40", "5", str(gold_out)])
            procs.append(gold_clients)
            time.sleep(6)
            flood = run_in(ns, [sys.executable, LOAD, "client", "127.0.0.1", str(bp), "127.0.0.1", "8", "0", "14",
                                "5", str(bronze_out)])
            procs.append(flood)
            assert flood.wait(60) == 0
            flood_end = time.monotonic()

            def restored() -> bool:
                """The loop's last word on bronze gives its CPU back (a restore before the flood, where gold neared
                its SLO on a busy host, is not the one waited for)."""
                said = [d for d in status(sock).get("decisions", []) if d["capability"] == "resources"
                        and d["target"] == "tier bronze"]
                return bool(said) and said[-1]["action"] == "restore"

            deadline = time.monotonic() + 25
            while not restored() and time.monotonic() < deadline:
                time.sleep(0.5)
            during = lab.read("cpu", bronze, quota_file)  # the agent still runs: the loop gave it back
            decisions = status(sock).get("decisions", [])
            gold_clients.wait(60)
        finally:
            agent.stop()
            agent.kill()
            subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *agent_argv("detach", "--config", str(cfg))],
                           env=agent_env(), capture_output=True, timeout=60, check=False)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    offset = time.time() - time.monotonic()  # decisions carry wall time, the clients CLOCK_MONOTONIC
    res = [d for d in decisions if d["capability"] == "resources" and d["target"] == "tier bronze"]
    cuts = [d for d in res if d["action"] == "cut"]
    adm_cuts = [d for d in decisions if d["capability"] == "admission" and d["target"] == "bronze-app"
                and d["action"] in ("cut", "shed")]
    summary = json.dumps({"resources": [(d["action"], d["new"], round(d["time"] - offset - t0, 1)) for d in res],
                          "admission": [(d["action"], d["new"], round(d["time"] - offset - t0, 1)) for d in adm_cuts],
                          "flood_s": [6, round(flood_end - t0, 1)]})
    assert cuts, f"bronze's CPU was never cut: {summary}\n{agent.output()[-3000:]}"
    first = cuts[0]
    assert first["applied"] and first["reason"] == "near_slo" and "gold" in first["inputs"]["why"], first
    # CPU before requests: admission's first cut of bronze (if the loop alone was not enough) comes after the
    # loop's first, and no bronze request failed before it.
    assert not adm_cuts or adm_cuts[0]["time"] > first["time"], summary
    failed = [r for r in json.loads(bronze_out.read_text()) if not r[2]]
    assert not [r for r in failed if r[0] < first["time"] - offset], summary
    assert res[-1]["action"] == "restore", f"not given back after the flood: {summary}"
    assert during == before, summary
    assert lab.read("cpu", bronze, quota_file) == before
