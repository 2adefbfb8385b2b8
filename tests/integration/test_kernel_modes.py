"""The latency modes the agent offers on this kernel agree with what the kernel's version has, and a mode it lacks
is refused with the reason, by `qosagent check` too. Runs natively and in every VM of the kernel matrix."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from qosagent.capability import State
from testkit.agent import agent_argv, agent_env
from tests.kernel_modes import ALL, features, kernel_version, offered_modes, verdict


def expected_modes() -> set[str]:
    """From the version: sock_ops' sendmsg callback since 6.15, the sock_*_length tracepoints since 6.4; kprobes
    where the kernel was built with them (Debian's are, this machine's 6.18 is not)."""
    v = kernel_version()
    out = set()
    if v >= (6, 15) and features().cgroup2:
        out.add("sockops")
    if v >= (6, 4):
        out.add("tracepoint")
    if os.path.exists("/sys/bus/event_source/devices/kprobe"):
        out.add("kprobe")
    return out


@pytest.mark.privileged
def test_the_modes_offered_are_the_kernels(root: None) -> None:
    assert set(offered_modes()) == expected_modes()
    assert offered_modes(), "no latency mode at all on this kernel"


@pytest.mark.privileged
@pytest.mark.parametrize("mode", ALL)
def test_a_mode_the_kernel_lacks_is_unavailable_with_the_reason(root: None, mode: str, tmp_path: Path) -> None:
    if mode in expected_modes():
        assert verdict(mode).state is not State.UNAVAILABLE
        return
    v = verdict(mode)
    assert v.state is State.UNAVAILABLE
    why = {"sockops": "kernel < 6.15", "tracepoint": "kernel < 6.4", "kprobe": "no kprobes"}[mode]
    assert why in v.reason, v.reason
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"latency:\n  mode: {mode}\n")
    out = subprocess.run(agent_argv("check", "--json", "--config", str(cfg)), env=agent_env(), capture_output=True,
                         text=True, timeout=120)
    lat = json.loads(out.stdout)["capabilities"]["latency"]
    assert lat["state"] == "unavailable" and why in lat["reason"], lat
