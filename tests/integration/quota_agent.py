"""Starting the agent of this checkout in a test's network namespace until its quota capability is active."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from testkit.agent import AgentProcess


def agent_of_layout(n: int, *args: str) -> list[str]:
    """This checkout's agent as if its pin layout were n: what an agent of another version leaves behind."""
    return [sys.executable, "-c", f"import qosagent.ebpf.pins as m; m.QUOTA_LAYOUT = {n}; "
            "from qosagent.cli import main; main()", *args]


def start_quota_agent(netns: str, config: Path, socket: str, log: Path, extra: Sequence[str] = (),
                      argv: Sequence[str] | None = None) -> AgentProcess:
    """nsenter, not `ip netns exec`: that remounts /sys, hiding the host's bpffs and the pins in it. argv: another
    command than this checkout's `qosagent run` (agent_of_layout)."""
    agent = AgentProcess(config, socket, log, prefix=["nsenter", f"--net=/run/netns/{netns}"], args=extra,
                         argv=argv)
    st = agent.start()
    if st["capabilities"].get("quota", {}).get("state") != "active":
        agent.kill()
        raise AssertionError(f"quota not active: {st['capabilities']}\n{agent.output()}")
    return agent
