"""The admission loop on the real latency probes, in dry-run: a bronze flood that pushes gold over its SLO makes
the loop decide to cut bronze first (and write nothing)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration import admission_harness as harness

pytestmark = [pytest.mark.privileged, pytest.mark.slow]


def test_a_bronze_flood_over_golds_slo_cuts_bronze_first(bpf: None, tmp_path: Path) -> None:
    dry_run = "{enabled: true, mode: dry-run}"
    with harness.scenario(tmp_path, quota="{enabled: false}", admission=dry_run) as (procs, agent, port):
        st = agent.status()
        assert st["capabilities"]["admission"]["state"] == "active", st["capabilities"]
        flood = procs.client(port, harness.BRONZE, 32, 0, 8, tmp_path / "flood.json")
        gold = procs.client(port, harness.GOLD, 2, 50, 8, tmp_path / "gold.json")
        gold_reqs = harness.results(gold, tmp_path / "gold.json")
        harness.results(flood, tmp_path / "flood.json")
        time.sleep(0.3)  # the status of the tick after the last request
        decisions = [d for d in agent.status(decisions=True)["decisions"] if d["capability"] == "admission"]
    # The flood did push gold over its SLO, as the client saw it; otherwise this test would prove nothing.
    assert harness.p95([ms for _, ms, _ in gold_reqs]) > harness.SLO_MS
    assert decisions, "no decision although gold was over its SLO"
    first = decisions[0]
    assert (first["target"], first["action"], first["reason"]) == ("bronze-app", "cut", "slo_breach")
    assert first["inputs"]["breach_tier"] == "gold" and first["inputs"]["observed_s"] > harness.SLO_MS / 1000
    assert first["old"] == 400 and first["new"] < 400 and not first["applied"]
    assert all(not d["applied"] for d in decisions)
