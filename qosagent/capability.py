"""The small face every capability shows the daemon: probe, start, collect, decide, apply, stop.

The daemon iterates over enabled capabilities and knows none of their insides, so each can be switched off,
tested or rehearsed (dry-run) alone.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

from qosagent.hostfs import HostFS
from qosagent.snapshot import Decision, Snapshot

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features
    from qosagent.gpu.backend import GpuBackend


class State(str, enum.Enum):
    ACTIVE = "active"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"
    DISABLED = "disabled"


@dataclass(frozen=True)
class Verdict:
    """What probing found: whether the capability can run here, and why not or why only partly."""

    state: State
    reason: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"state": self.state.value, "reason": self.reason}


class CapabilityError(Exception):
    """A capability cannot start or went wrong in a way the daemon reports; message is for the operator."""


@dataclass
class AgentContext:
    """What a capability may touch: the host through seams, never directly."""

    config: "Config"
    hostfs: HostFS
    gpu: "GpuBackend"
    clock: Callable[[], float] = time.monotonic
    # What one capability offers another, by a dotted name (e.g. "quota.limits" -> tenants.LimitsWriter).
    services: dict[str, Any] = field(default_factory=dict)
    # A clean stop hands enforcement over to the next agent where a capability can (quota's filter and pins stay);
    # True makes stop() remove everything, as `qosagent detach` would.
    detach_on_exit: bool = False
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("qosagent"))


class Capability:
    name: ClassVar[str]

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.log = logging.getLogger(f"qosagent.{self.name}")
        self.verdict = Verdict(State.UNAVAILABLE, "not probed")

    @classmethod
    def enabled(cls, config: "Config") -> bool:
        return bool(getattr(config, cls.name).enabled)

    def probe(self, features: "Features") -> Verdict:
        """Whether this host supports the capability; must not change the host."""
        raise NotImplementedError

    def start(self) -> None:
        """Load, attach, save originals. Raise CapabilityError with an operator-facing message."""

    def started(self, verdict: Verdict) -> Verdict:
        """The verdict once started: start() may have found less than probe() promised (a program the kernel's
        verifier refused, say) and carried on without it."""
        return verdict

    def collect(self) -> Any:
        """This tick's immutable part of the Snapshot."""
        return None

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        """Pure: decisions from the snapshot and the capability's own previous decision state."""
        return []

    def apply(self, decisions: list[Decision]) -> None:
        """Write what was decided (nothing in dry-run)."""

    def reload(self, config: "Config") -> None:
        """Take a new, already validated config in place; raise CapabilityError to keep the old one."""

    def stop(self) -> None:
        """Undo everything start() and apply() did, in reverse; safe to call twice. Quota alone leaves its
        datapath for the next agent unless ctx.detach_on_exit."""

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        """Without a running agent: remove what an agent of this capability left (a crash, `qosagent detach`).

        Returns one line per thing removed or restored."""
        return []

    def metrics(self, snapshot: Snapshot) -> Iterable["Metric"]:
        return ()

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        """JSON-able state for `qosagent status --json`."""
        return {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        """Human text for this capability's status part (runs in the CLI, on the JSON)."""
        return ""


def registry() -> list[type[Capability]]:
    """All capabilities, in start and tick order: measurement first, then the ones that decide on it. Quota starts
    before latency because latency reads quota's pinned flow map (header-matched tenants)."""
    from qosagent.admission.capability import Admission
    from qosagent.dvfs.capability import Dvfs
    from qosagent.latency.capability import Latency
    from qosagent.placement.capability import Placement
    from qosagent.quota.capability import Quota

    return [Quota, Latency, Admission, Dvfs, Placement]
