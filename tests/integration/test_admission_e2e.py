"""End to end, as root: the closed loop on a real server, the real latency probes and the real TC classifier.

Inside a network namespace of its own (its `lo` only; the host's interfaces are never touched), one server with a
fixed worker pool serves a gold tenant (127.0.0.2) and a bronze tenant (127.0.0.3). Bronze floods; the agent
throttles bronze until gold's P95 is under its SLO, and lets bronze back up after the flood. Then the fake GPU reports
95 % memory: bronze is shed within 2 ticks, gold untouched. Then the agent is killed with SIGKILL while shedding: once
the quota heartbeat times out, the kernel serves bronze on its baseline limit again.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration.admission_harness import (
    BRONZE,
    GOLD,
    SLO_MS,
    p95,
    results,
    scenario,
    wait_for,
    write_json,
)

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

GOLD_ACTIONS = ("cut", "raise", "restore", "shed", "unshed")


def test_closed_loop_end_to_end(bpf: None, tmp_path: Path) -> None:
    quota = "{enabled: true, interfaces: [lo], heartbeat_timeout: 2s}"
    admission = "{enabled: true, mode: enforce, cooldown: 5s, gpu_pressure: {gpus: [0], escalate_after: 1h}}"
    with scenario(tmp_path, quota, admission) as (procs, agent, port):
        caps = agent.status()["capabilities"]
        assert {n: caps[n]["state"] for n in ("latency", "quota", "admission")} == {
            "latency": "active", "quota": "active", "admission": "active"}, caps

        # ---- bronze floods: the loop throttles bronze until gold is back under its SLO ----
        flood = procs.client(port, BRONZE, 32, 0, 12, tmp_path / "flood.json")
        gold = procs.client(port, GOLD, 2, 50, 12, tmp_path / "gold1.json")
        cut = wait_for("a cut of bronze", lambda: agent.decisions("bronze-app", "cut"), 20)
        t_cut = time.monotonic()
        assert cut[0]["reason"] == "slo_breach" and cut[0]["inputs"]["breach_tier"] == "gold"
        gold_reqs = results(gold, tmp_path / "gold1.json")
        results(flood, tmp_path / "flood.json")
        before = [ms for t, ms, _ in gold_reqs if t < t_cut]
        # Once the cuts have had a window to work, and before the cooldown lets recovery probe upwards again.
        settled = [ms for t, ms, _ in gold_reqs if t_cut + 2 < t < t_cut + 5]
        assert before and p95(before) > SLO_MS, "the flood did not push gold over its SLO: the test proves nothing"
        assert len(settled) > 20 and p95(settled) < SLO_MS, (p95(before), p95(settled))
        assert agent.decisions("gold-app", *GOLD_ACTIONS) == []
        bronze = agent.status()["admission"]["tenants"][1]
        assert bronze["tenant"] == "bronze-app" and bronze["adaptive"]

        # ---- the flood is over: bronze, two at a time, pressing its limit, gets it raised back ----
        calm = procs.client(port, BRONZE, 2, 0, 20, tmp_path / "calm.json")
        wait_for("bronze raised after the flood", lambda: agent.decisions("bronze-app", "raise", "restore"), 25)
        results(calm, tmp_path / "calm.json")
        assert agent.decisions("gold-app", *GOLD_ACTIONS) == []

        # ---- GPU memory at 95 %: bronze shed within 2 ticks, gold untouched ----
        seq0 = agent.status()["seq"]
        write_json(tmp_path / "gpu.json", {"preset": "single", "gpus": {"0": {"memory_used_ratio": 0.95}}})
        shed = wait_for("bronze shed", lambda: agent.decisions("bronze-app", "shed"), 10)
        assert shed[0]["inputs"]["tick"] <= seq0 + 2, (seq0, shed[0]["inputs"]["tick"])
        assert shed[0]["new"] == 0 and shed[0]["reason"] == "gpu_memory_pressure"
        gold2 = procs.client(port, GOLD, 1, 50, 3, tmp_path / "gold2.json")
        bronze2 = procs.client(port, BRONZE, 1, 50, 3, tmp_path / "bronze2.json", timeout=1.0)
        gold2_reqs = results(gold2, tmp_path / "gold2.json")
        bronze2_reqs = results(bronze2, tmp_path / "bronze2.json")
        assert gold2_reqs and all(ok for _, _, ok in gold2_reqs)
        assert bronze2_reqs and not any(ok for _, _, ok in bronze2_reqs)
        assert agent.decisions("gold-app", *GOLD_ACTIONS) == []

        # ---- kill -9 while shedding: the heartbeat times out and bronze is served on its baseline again ----
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        after = procs.client(port, BRONZE, 1, 200, 8, tmp_path / "after.json", timeout=10.0)
        after_reqs = results(after, tmp_path / "after.json")
        assert any(ok for _, _, ok in after_reqs), after_reqs
