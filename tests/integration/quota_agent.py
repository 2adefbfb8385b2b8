"""Starting the agent of this checkout in a test's network namespace until its quota capability is active."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from qosagent.status import NoAgent, request
from tests.conftest import TIME_SCALE, agent_argv, agent_env


def agent_of_layout(n: int, *args: str) -> list[str]:
    """This checkout's agent as if its pin layout were n: what an agent of another version leaves behind."""
    return [sys.executable, "-c", f"import qosagent.quota.layout as m; m.LAYOUT = {n}; "
            "from qosagent.cli import main; main()", *args]


def start_quota_agent(netns: str, config: Path, socket: str, log: Path, extra: Sequence[str] = (),
                      argv: Sequence[str] | None = None) -> subprocess.Popen:
    """nsenter, not `ip netns exec`: that remounts /sys, hiding the host's bpffs and the pins in it."""
    cmd = list(argv) if argv is not None else agent_argv("run", "--config", str(config), *extra)
    with open(log, "a") as out:
        agent = subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", *cmd],
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
