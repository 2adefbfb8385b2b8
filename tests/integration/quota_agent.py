"""Starting the agent of this checkout in a test's network namespace until its quota capability is active."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from qosagent.status import NoAgent, request
from testkit.agent import agent_argv, agent_env, TIME_SCALE


def start_quota_agent(netns: str, config: Path, socket: str, log: Path) -> subprocess.Popen:
    """nsenter, not `ip netns exec`: that remounts /sys, hiding the host's bpffs and the pins in it."""
    with open(log, "a") as out:
        agent = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}",
                                  *agent_argv("run", "--config", str(config))],
                                 env=agent_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 60 * TIME_SCALE
    while time.time() < deadline:
        assert agent.poll() is None, log.read_text()
        try:
            st = request(socket, {"cmd": "status"}, timeout=2)
            if st.get("seq", 0) > 0 and "quota" in st:
                assert st["capabilities"]["quota"]["state"] == "active", st["capabilities"]
                return agent
        except (NoAgent, OSError):
            pass
        time.sleep(0.2)
    agent.kill()
    agent.wait(10)
    raise AssertionError(f"agent not ready in {60 * TIME_SCALE:.0f} s\n" + log.read_text())
