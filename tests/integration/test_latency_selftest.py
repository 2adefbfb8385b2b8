"""The latency self-test for real: after attaching, the hooks on every socket's path are seen running for a loopback
connection of the agent's own; where one is attached but never runs, the capability is degraded and names it. Where
the kernel's run statistics are refused (no CAP_SYS_ADMIN), real traffic on a tracked port verifies the hooks, or
finds them silent."""

from __future__ import annotations

import errno
import http.client
import time
from typing import Any, Collection, Mapping

import pytest

from qosagent.capability import State, Verdict
from qosagent.latency import links, selftest
from tests.integration.latency_helpers import serving
from tests.integration.test_latency_probes import Handler, get, started
from tests.kernel_modes import latency_modes


@pytest.mark.privileged
@pytest.mark.parametrize("mode", latency_modes())
def test_hooks_seen_running_keep_the_verdict(bpf: None, mode: str) -> None:
    with started(mode) as cap:
        v = cap.verified(Verdict(State.ACTIVE, "as probed"))
    assert v == Verdict(State.ACTIVE, "as probed")


@pytest.mark.privileged
@pytest.mark.parametrize("mode", latency_modes())
def test_hooks_that_never_run_are_named_and_degrade(bpf: None, cgroup: str, mode: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The programs the agent links on the cgroup2 root go on an empty cgroup instead: attached, accepted by the
    # kernel, and never run for any socket (no process lives there). As on a host whose sockets are in another
    # hierarchy than the one the agent found.
    def empty_root(_fs: Any) -> str:
        return cgroup

    monkeypatch.setattr(links, "cgroup_root", empty_root)
    with started(mode) as cap:
        v = cap.verified(Verdict(State.ACTIVE, ""))
    assert v.state is State.DEGRADED
    silent = "lat_egress_learn, lat_ingress_learn, lat_sockops" if mode == "sockops" else "lat_egress"
    assert f"self-test: {silent} did not run" in v.reason, v.reason
    # The tracepoints and kprobes, on every socket's path, did run: they are not named.
    assert "tracepoint__" not in v.reason and "kp_" not in v.reason, v.reason


@pytest.fixture
def stats_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-test as it runs without CAP_SYS_ADMIN: BPF_ENABLE_STATS refused with EPERM."""
    def refuse() -> int:
        raise OSError(errno.EPERM, "Operation not permitted")

    check = selftest.check

    def refused(programs: Mapping[str, int], avoid: Collection[int] = (), **kw: Any) -> str | None:
        return check(programs, avoid, enable_stats=refuse, **kw)

    monkeypatch.setattr(selftest, "check", refused)


def verdict_after(cap: Any, seconds: float, until: str) -> Verdict:
    """The capability's verdict once its reason contains `until`, or after `seconds` of ticks (collect)."""
    end = time.monotonic() + seconds
    while until not in cap.verdict.reason and time.monotonic() < end:
        cap.collect()
        time.sleep(0.2)
    return cap.verdict


@pytest.mark.privileged
@pytest.mark.parametrize("mode", latency_modes())
def test_without_run_statistics_real_traffic_verifies_the_hooks(bpf: None, stats_refused: None, mode: str) -> None:
    with started(mode) as cap, serving((18014,), Handler):
        assert cap.verdict.state is State.ACTIVE
        assert cap.verdict.reason.endswith("hooks not verified at start (BPF run statistics: Operation not "
                                           "permitted), awaiting traffic"), cap.verdict.reason
        cap.collect()
        assert "awaiting traffic" in cap.verdict.reason, "nothing came yet: nothing is verified"
        get(18014, "127.0.0.1", 2)
        v = verdict_after(cap, 10, "by traffic")
    assert v.state is State.ACTIVE
    assert "hooks verified at " in v.reason and " by traffic (" in v.reason, v.reason
    assert "awaiting traffic" not in v.reason and "not verified" not in v.reason, v.reason


@pytest.mark.privileged
@pytest.mark.parametrize("mode", latency_modes("sockops"))
def test_without_run_statistics_traffic_nothing_counts_degrades(bpf: None, stats_refused: None, cgroup: str,
                                                                mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # As in the test above it: the sockops program linked where no socket passes (only sockops counts connections
    # and requests; in the other modes tracepoints or kprobes on every socket's path do).
    def empty_root(_fs: Any) -> str:
        return cgroup

    monkeypatch.setattr(links, "cgroup_root", empty_root)
    with started(mode, verify_within=1.0) as cap, serving((18014,), Handler):
        # A keep-alive connection opened after start, held while the agent lists the tracked ports' connections.
        conn = http.client.HTTPConnection("127.0.0.1", 18014, timeout=10)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            v = verdict_after(cap, 10, "not seen running")
        finally:
            conn.close()
    assert v.state is State.DEGRADED, v
    assert "hooks not seen running: connections came on the tracked ports for 1 s and no program counted one" \
        in v.reason, v.reason
