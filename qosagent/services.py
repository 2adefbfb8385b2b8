"""The small face of what the agent runs once for several capabilities (the serving-namespace scan, the runtime's
pods): made by the daemon before the capabilities that use it start, asked by them through AgentContext.service,
read into the tick's Snapshot after they collect, reported beside them and stopped after the last of them.

Like capability.py this imports no implementation: the daemon (the composition root, qosagent/capabilities.py)
names the services each capability uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, TypeVar

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.hostfs import HostFS


class Service:
    # Its part's name in the Snapshot, its key in `qosagent status --json` and in AgentContext.services.
    name: ClassVar[str]

    @classmethod
    def make(cls, fs: "HostFS", clock: Callable[[], float]) -> "Service":
        """The one instance an agent runs (cheap: nothing is asked of the host until a capability asks it)."""
        raise NotImplementedError

    @classmethod
    def problem(cls, config: "Config", fs: "HostFS") -> str | None:
        """For `qosagent check`: why what the config asks of this service cannot be had on this host, or None."""
        return None

    def collect(self) -> Any:
        """This tick's immutable part of the Snapshot (after the capabilities collected theirs); reads only."""
        return None

    def metrics(self, part: Any, config: "Config") -> Iterable["Metric"]:
        return ()

    def status(self, part: Any) -> dict[str, Any] | None:
        """JSON-able state for `qosagent status --json`; None shows nothing."""
        return None

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        """Human text for this service's status part (runs in the CLI, on the JSON)."""
        return ""

    def stop(self) -> None:
        """Called once, after every capability stopped: no thread of the service left running."""


S = TypeVar("S", bound=Service)


def shared(services: dict[str, Any], kind: type[S], fs: "HostFS", clock: Callable[[], float]) -> S:
    """services[kind.name]: in the agent the one the daemon made before any capability started; outside it (a test,
    a bench driving one capability) made by the first that asks."""
    found = services.get(kind.name)
    if found is None:
        found = services[kind.name] = kind.make(fs, clock)
    return found
