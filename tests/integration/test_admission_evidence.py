"""Evidence before GPU memory, end to end as root (issue 23): the quota classifier enforcing in a namespace of the
test's own, limits read back from the kernel's quota_limits map.

A vLLM-shaped server (metrics from inference_metrics.py, its requests served by the worker pool) reports KV 30 %
while the fake GPU says 92 % memory used with no process of the server's listed: an empty NVML process list (many
containers), PIDs of another PID namespace, MIG instances. Nobody may be limited. Then the KV cache fills and a
queue builds: bronze is cut first, gold never below its floor and never by the GPU path, and recovery is paced.
Last, a GPU that no server reads, its memory growing past the operator's threshold: only the sheddable tier is
shed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.admission_harness import (
    BRONZE,
    GOLD,
    kernel_limits,
    results,
    scenario,
    wait_for,
    write_json,
)

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

METRICS_SERVER = str(Path(__file__).with_name("inference_metrics.py"))
TENANTS = ("gold-app", "bronze-app")
GPU_ACTIONS = ("shed", "unshed")


def held(agent: Any, procs: Any, port: int, tmp: Path, seconds: float, tag: str) -> list[dict[str, Any]]:
    """Both tenants send a few requests a second for `seconds`; every request must be served. Returns the kernel's
    limits read once a second meanwhile."""
    gold = procs.client(port, GOLD, 1, 100, seconds, tmp / f"gold-{tag}.json")
    bronze = procs.client(port, BRONZE, 1, 100, seconds, tmp / f"bronze-{tag}.json")
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(kernel_limits(agent, *TENANTS))
        time.sleep(1.0)
    reqs = results(gold, tmp / f"gold-{tag}.json") + results(bronze, tmp / f"bronze-{tag}.json")
    print(f"kernel limits ({tag}), first and last read:", seen[0], seen[-1])
    assert len(reqs) > 2 * seconds and all(ok for _, _, ok in reqs), [r for r in reqs if not r[2]][:5]
    return seen


def test_a_server_reading_overrides_gpu_memory_in_the_kernel(bpf: None, tmp_path: Path) -> None:
    quota = "{enabled: true, interfaces: [lo], heartbeat_timeout: 2s}"
    admission = ("{enabled: true, mode: enforce, cooldown: 1s, healthy_ticks: 5, "
                 "gpu_pressure: {gpus: [0], escalate_after: 1s}, server_pressure: {cut_every: 300ms}}")
    control = tmp_path / "vllm.json"
    write_json(control, {"kv": 0.30, "waiting": 0, "running": 4})
    mport = 19000  # the namespace is the test's own: nothing else listens there (the agent and server are >= 20000)
    servers = f'servers: [{{port: $PORT, kind: vllm, metrics: "http://127.0.0.1:{mport}/metrics"}}]'
    with scenario(tmp_path, quota, admission, gold="quota: {rps: 200, burst: 50}, floor: {rps: 50, burst: 50}",
                  bronze="sheddable: true", extra=servers) as (procs, agent, port):
        caps = agent.wait_ready()["capabilities"]
        assert {n: caps[n]["state"] for n in ("quota", "servers", "admission")} == {
            "quota": "active", "servers": "active", "admission": "active"}, caps
        procs.start([sys.executable, METRICS_SERVER, "vllm", str(mport), str(control)])
        wait_for("the server's reading", lambda: (s := agent.status().get("servers")) and s["servers"][0]["known"]
                 and s, 30)
        baseline = {"gold-app": {"baseline": (200.0, 50), "override": None},
                    "bronze-app": {"baseline": (400.0, 40), "override": None}}
        assert kernel_limits(agent, *TENANTS) == baseline

        # ---- GPU at 92 %, NVML listing no process (a container without hostPID): nobody limited ----
        write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {
            "memory_used_ratio": 0.92, "processes": []}}})
        seen = held(agent, procs, port, tmp_path, 6, "empty")
        print("kernel limits, GPU 92 %, no process list, KV 0.30:", seen[-1])
        assert all(k == baseline for k in seen), seen
        st = agent.status()["admission"]
        assert st["gpu"] == f"not shedding: the server reports KV 30 % on port {port} (GPU 0 memory 92%)", st
        assert st["shed_tiers"] == 0 and all(t["signal"] == "config" for t in st["tenants"])
        assert agent.decisions("gold-app") == [] and agent.decisions("bronze-app") == []

        # ---- the same with PIDs the agent cannot see (the server in another PID namespace) ----
        foreign = 4_000_000
        assert not os.path.exists(f"/proc/{foreign}")
        write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {
            "memory_used_ratio": 0.92, "processes": [[foreign, 130 << 30]]}}})
        seen = held(agent, procs, port, tmp_path, 3, "foreign")
        assert all(k == baseline for k in seen), seen
        assert agent.status()["admission"]["gpus"][0]["evidence"] == "server"

        # ---- MIG instances, memory per instance, the serving one at 92 % ----
        write_json(tmp_path / "gpu.json", {"preset": "h100-mig", "gpus": {
            "0": {"memory_used_ratio": 0.92}, "1": {"memory_used_ratio": 0.97}}})
        seen = held(agent, procs, port, tmp_path, 3, "mig")
        assert all(k == baseline for k in seen), seen
        g = agent.status()["admission"]["gpus"]
        assert [(x["gpu"], x["evidence"], x["counts"]) for x in g] == [(0, "server", False)], g
        assert agent.decisions("gold-app") == [] and agent.decisions("bronze-app") == []

        # ---- KV 0.99 and 20 waiting: bronze cut first; gold never by the GPU path, never under its floor ----
        write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {
            "memory_used_ratio": 0.92, "processes": []}}})
        write_json(control, {"kv": 0.99, "waiting": 20, "running": 48})
        gold = procs.client(port, GOLD, 1, 50, 8, tmp_path / "gold-full.json")
        flood = procs.client(port, BRONZE, 2, 0, 8, tmp_path / "flood.json", timeout=1.0)
        wait_for("bronze at min_rps", lambda: any(d["new"] == 1.0 for d in agent.decisions("bronze-app", "cut")), 20)
        floor = kernel_limits(agent, *TENANTS)
        print("kernel limits, KV 0.99 and 20 waiting:", floor)
        assert floor["bronze-app"]["override"] == (1.0, 1), floor
        gold_reqs = results(gold, tmp_path / "gold-full.json")
        results(flood, tmp_path / "flood.json")
        assert gold_reqs and all(ok for _, _, ok in gold_reqs)
        cuts = [d for d in agent.status(decisions=True)["decisions"] if d["capability"] == "admission"]
        assert cuts[0]["target"] == "bronze-app" and {d["reason"] for d in cuts} == {"server_pressure"}, cuts
        assert all(d["new"] >= 50 for d in cuts if d["target"] == "gold-app"), cuts
        g_override = kernel_limits(agent, *TENANTS)["gold-app"]["override"]
        assert g_override is None or g_override[0] >= 50, g_override

        # ---- the cache drains: bronze, pressing its limit, is raised back, one step per healthy_ticks ----
        write_json(control, {"kv": 0.40, "waiting": 0, "running": 8})
        calm = procs.client(port, BRONZE, 2, 0, 15, tmp_path / "calm.json", timeout=1.0)
        raised = wait_for("bronze raised twice", lambda: len(r := agent.decisions("bronze-app", "raise")) >= 2 and r,
                          15)
        results(calm, tmp_path / "calm.json")
        assert {d["reason"] for d in raised} == {"server_relieved"}
        ticks = [d["inputs"]["tick"] for d in raised]
        assert all(b - a >= 5 for a, b in zip(ticks, ticks[1:])), ticks
        up = kernel_limits(agent, *TENANTS)["bronze-app"]["override"]
        assert up is None or up[0] > 1.0, up
        assert agent.decisions("gold-app", *GPU_ACTIONS) == [] and agent.decisions("bronze-app", *GPU_ACTIONS) == []


def test_gpu_memory_growing_past_the_operators_threshold_sheds_only_the_sheddable_tier(
        bpf: None, tmp_path: Path) -> None:
    """No server reading at all (`servers: []`): GPU memory is the signal, counted once it grows past enter."""
    quota = "{enabled: true, interfaces: [lo], heartbeat_timeout: 2s}"
    admission = "{enabled: true, mode: enforce, gpu_pressure: {gpus: [0], enter: 0.80, exit: 0.70, escalate_after: 1s}}"
    with scenario(tmp_path, quota, admission, gold="quota: {rps: 200, burst: 50}", bronze="sheddable: true",
                  extra="servers: []") as (procs, agent, port):
        agent.wait_ready()
        baseline = {"gold-app": {"baseline": (200.0, 50), "override": None},
                    "bronze-app": {"baseline": (400.0, 40), "override": None}}
        for ratio in (0.30, 0.60, 0.78):  # growing, still under the operator's enter
            write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {"memory_used_ratio": ratio}}})
            time.sleep(0.5)
        assert kernel_limits(agent, *TENANTS) == baseline
        write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {"memory_used_ratio": 0.86}}})
        shed = wait_for("bronze shed", lambda: agent.decisions("bronze-app", "shed"), 10)
        assert shed[0]["reason"] == "gpu_memory_pressure" and shed[0]["new"] == 0
        seen = []
        gold = procs.client(port, GOLD, 1, 100, 4, tmp_path / "gold.json")
        bronze = procs.client(port, BRONZE, 1, 100, 4, tmp_path / "bronze.json", timeout=1.0)
        for _ in range(4):  # past several escalate_after: gold is not sheddable, so nothing more is shed
            seen.append(kernel_limits(agent, *TENANTS))
            time.sleep(1.0)
        print("kernel limits, GPU memory grown 30 % -> 86 % > enter 0.80, no server:", seen[-1])
        assert all(k == {"gold-app": baseline["gold-app"],
                         "bronze-app": {"baseline": (400.0, 40), "override": (0.0, 0)}} for k in seen), seen
        gold_reqs, bronze_reqs = results(gold, tmp_path / "gold.json"), results(bronze, tmp_path / "bronze.json")
        assert gold_reqs and all(ok for _, _, ok in gold_reqs)
        assert bronze_reqs and not any(ok for _, _, ok in bronze_reqs)
        st = agent.status()["admission"]
        assert st["shed_tiers"] == 1 and st["gpu"] == "pressure (max 86.0% on GPU 0)", st
        gold_st = next(t for t in st["tenants"] if t["tenant"] == "gold-app")
        assert (gold_st["signal"], gold_st["rule"]) == ("config", "baseline"), gold_st
        assert agent.decisions("gold-app") == []
        # ---- memory back under exit: bronze served on its baseline again ----
        write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {"memory_used_ratio": 0.50}}})
        wait_for("bronze unshed", lambda: agent.decisions("bronze-app", "unshed"), 10)
        assert kernel_limits(agent, *TENANTS) == baseline
