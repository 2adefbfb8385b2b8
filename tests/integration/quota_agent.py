"""Starting the agent of this checkout in a test's network namespace until its quota capability is active."""

from __future__ import annotations

from pathlib import Path

from testkit.agent import AgentProcess


def start_quota_agent(netns: str, config: Path, socket: str, log: Path) -> AgentProcess:
    """nsenter, not `ip netns exec`: that remounts /sys, hiding the host's bpffs and the pins in it."""
    agent = AgentProcess(config, socket, log, prefix=["nsenter", f"--net=/run/netns/{netns}"])
    st = agent.start()
    if st["capabilities"].get("quota", {}).get("state") != "active":
        agent.kill()
        raise AssertionError(f"quota not active: {st['capabilities']}\n{agent.output()}")
    return agent
