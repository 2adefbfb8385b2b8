"""The latency self-test for real: after attaching, the hooks on every socket's path are seen running for a loopback
connection of the agent's own; where one is attached but never runs, the capability is degraded and names it."""

from __future__ import annotations

from typing import Any

import pytest

from qosagent.capability import State, Verdict
from qosagent.latency import links
from tests.integration.test_latency_probes import started
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
