"""Fleet quotas for real: three agents, each in its own network namespace with its own server and clients, a real
etcd and two allocator replicas in a hub namespace (tests/integration/fleetlab.py).

One fleet for the module (three BPF compiles are the slow part); the scenarios run in order and each starts from
its own load. Quota 60 request starts per second over the fleet (burst 12, so a node's bucket absorbs the
bunching of TCP's retransmissions), report interval 0.5 s, lease 2 s."""

from __future__ import annotations

import shutil
import signal
import time
from typing import Iterator

import pytest

from qosagent.fleet.alloc import minimum
from tests.conftest import require
from tests.integration.fleetlab import Fleet
from tests.integration.netlab import sh

pytestmark = pytest.mark.privileged

QUOTA = 60.0
BURST = 12  # fleet-wide, split among the nodes like the rate
M = minimum(QUOTA, 3)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    import os

    require(os.geteuid() == 0, "needs root (netns, BPF)")
    require(shutil.which("etcd") is not None, "needs etcd (Debian's etcd-server: QOSAGENT_SETUP_TEST=1 make setup)")
    f = Fleet(tmp_path_factory.mktemp("fleet"), nodes=3, quota=QUOTA, burst=BURST)
    try:
        f.start_allocator("alloc-a")
        f.start_allocator("alloc-b")
        f.start_agents()
        yield f
    finally:
        f.close()


def _converged_on(f: Fleet, busy: list[str]) -> bool:
    """The busy nodes hold (on a lease) all but the idle nodes' minimums, the idle ones about their minimum."""
    s = {n: f.share(n) for n in f.nodes}
    if any(t["source"] != "lease" for t in s.values()):
        return False
    idle = [n for n in f.nodes if n not in busy]
    return sum(s[n]["node_rps"] for n in busy) >= 0.9 * (QUOTA - len(idle) * M) and \
        all(s[n]["node_rps"] <= 3 * M for n in idle)


def test_the_fleet_admits_its_quota_while_demand_moves_between_nodes(fleet: Fleet) -> None:
    f = fleet
    f.load("node-1", threads=12, duration=60)
    f.wait("node-1 holding the quota", lambda: _converged_on(f, ["node-1"]), timeout=30)
    rate, per = f.admitted_rate(4)
    assert abs(rate - QUOTA) <= 0.1 * QUOTA, (rate, per)
    # The shift: node-1's clients stop, node-2's and node-3's start.
    f.unload("node-1")
    f.load("node-2", threads=12, duration=120)
    f.load("node-3", threads=12, duration=120)
    took = f.wait("the quota moving to node-2 and node-3", lambda: _converged_on(f, ["node-2", "node-3"]),
                  timeout=30)
    print(f"\nconvergence after the shift: {took:.2f} s (report interval {f.report_interval} s)")
    # The clients held off before (TCP's retransmission backoff, up to seconds) catch up before the rate is taken.
    time.sleep(3)
    rate, per = f.admitted_rate(4)
    assert abs(rate - QUOTA) <= 0.1 * QUOTA, (rate, per)
    assert per["node-1"] <= 2 * M + 1, per


def test_a_partitioned_node_loses_its_share_after_its_lease_and_the_others_take_it(fleet: Fleet) -> None:
    f = fleet
    f.wait("node-2 and node-3 busy", lambda: _converged_on(f, ["node-2", "node-3"]), timeout=30)
    sh("ip", "-n", f.ns["node-3"], "link", "set", "eth0", "down")
    try:
        took = f.wait("node-3's grant freed", lambda: "node-3" not in f.grants(), timeout=f.lease + 10)
        assert took >= f.lease - 2 * f.report_interval, took  # not before its lease could have run out
        f.wait("node-2 taking node-3's share", lambda: f.share("node-2")["node_rps"] >= 0.9 * (QUOTA - M),
               timeout=15)
        f.wait("node-3 on its safe share", lambda: f.share("node-3")["source"] == "safe", timeout=f.lease + 5)
        assert f.share("node-3")["node_rps"] == pytest.approx(QUOTA / 3, rel=0.01)
    finally:
        sh("ip", "-n", f.ns["node-3"], "link", "set", "eth0", "up")
    f.wait("node-3 back on a lease", lambda: _converged_on(f, ["node-2", "node-3"]), timeout=30)


def test_the_leader_killed_a_standby_takes_over_without_the_fleet_exceeding_its_quota(fleet: Fleet) -> None:
    f = fleet
    f.wait("node-2 and node-3 busy", lambda: _converged_on(f, ["node-2", "node-3"]), timeout=30)
    old = f.leader()
    assert old is not None
    standby = next(n for n in f.allocators if n != old)
    f.allocators[old].send_signal(signal.SIGKILL)
    f.allocators[old].wait(10)
    worst = 0.0
    took = None
    # Every second until the standby leads and every node is back on a lease: the fleet's admitted rate.
    for _ in range(int(4 * f.lease + 10)):
        rate, _per = f.admitted_rate(1.0)
        worst = max(worst, rate)
        if f.allocator_metrics(standby).get("qosagent_allocator_leader") == 1.0 and \
                all(f.share(n)["source"] == "lease" for n in f.nodes):
            took = True
            break
    assert took, f"no takeover\n{f.logs()}"
    # The slack: the safe shares of the nodes between leases (QUOTA/3 each) never add up past the quota. In any second
    # the nodes' buckets admit at most the rate and their bursts, which add up to the fleet's (CI, 2026-12-02: 66.8 a
    # second in the takeover, within 60 + 12, above the 66 this bound was once); a node keeping its old lease's share
    # beside the others' safe ones would be 98.
    assert worst <= QUOTA + BURST, worst
    assert f.allocator_metrics(standby)["qosagent_allocator_leader_changes_total"] >= 1
    f.start_allocator(old)  # back as the standby
    f.wait("node-2 and node-3 busy again", lambda: _converged_on(f, ["node-2", "node-3"]), timeout=30)


def test_etcd_stopped_every_node_falls_back_to_its_safe_share_after_the_lease(fleet: Fleet) -> None:
    f = fleet
    f.stop_etcd()
    took = f.wait("every node on its safe share", lambda: all(f.share(n)["source"] == "safe" for n in f.nodes),
                  timeout=f.lease + 5)
    assert took >= f.lease - 3 * f.report_interval, took  # the grants were kept until their leases ran out
    for n in f.nodes:
        s = f.share(n)
        assert s["node_rps"] == pytest.approx(QUOTA / 3, rel=0.01) and not s["etcd_up"] and s["report_errors"] > 0
    rate, per = f.admitted_rate(3)
    assert rate <= 1.1 * QUOTA * 2 / 3 + 2, (rate, per)  # node-2 and node-3 busy, each at its third
