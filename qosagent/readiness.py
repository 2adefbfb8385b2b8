"""What /readyz answers: ready once the first tick is done and every capability the config enables is active or
idle (nothing on this host for it to act on), or listed in readiness.optional. A capability degraded or
unavailable (what was asked did not work, or a tick error) makes the agent unready until it recovers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosagent.capability import State

if TYPE_CHECKING:
    from qosagent.daemon import Agent


READY = (State.ACTIVE, State.IDLE, State.DISABLED)


def readiness(agent: "Agent") -> tuple[bool, str]:
    """(ready, why): the why names each capability that keeps the agent unready, with its state and reason."""
    if not agent.ready.is_set():
        return False, "starting"
    optional = set(agent.config.readiness.optional)
    missing = [f"{name} {v.state.value}" + (f": {v.reason}" if v.reason else "")
               for name, v in agent.verdicts.items()
               if v.state not in READY and name not in optional]
    if missing:
        return False, "; ".join(missing)
    return True, "ready"
