"""The small face every capability shows the daemon: probe, start, collect, decide, apply, stop.

The daemon iterates over enabled capabilities and knows none of their insides, so each can be switched off,
tested or rehearsed (dry-run) alone.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Container, Iterable, Mapping, NamedTuple, TypeVar

from qosagent import services as services_mod
from qosagent.hostfs import HostFS
from qosagent.retention import EVERYONE
from qosagent.sandbox import Need
from qosagent.services import Service
from qosagent.snapshot import Decision, Snapshot

if TYPE_CHECKING:
    from qosagent.ebpf.mapsize import MapSize
    from prometheus_client.core import Metric

    from qosagent.config import Config
    from qosagent.features import Features
    from qosagent.gpu.backend import GpuBackend, GpuState


class State(str, enum.Enum):
    ACTIVE = "active"
    # Enabled and sound, with nothing on this host to act on (no server to read, no frequency knob): the host's
    # circumstance, not a failure, so it does not keep the agent unready. DEGRADED and UNAVAILABLE are what was
    # asked for and did not work (a refused program, a config the host contradicts, a failing tick): they do.
    IDLE = "idle"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"
    DISABLED = "disabled"


class Attention(NamedTuple):
    """What `qosagent status` ranks a tenant by, most first: in breach of its SLO, throttled (requests dropped, or
    a limit held below its configured one), then its requests per second."""

    breaching: bool = False
    throttled: bool = False
    rps: float = 0.0

    def __or__(self, other: "tuple[Any, ...]") -> "Attention":  # two capabilities' views of one tenant
        o = Attention(*other)
        return Attention(self.breaching or o.breaching, self.throttled or o.throttled, max(self.rps, o.rps))


@dataclass(frozen=True)
class Verdict:
    """What probing found: whether the capability can run here, and why not or why only partly; and the plan,
    what start() is to do with what was found (the capability's own type). Probe leaves nothing on the object, so
    `qosagent check` and the agent probe alike and start acts on what the verdict said."""

    state: State
    reason: str = ""
    plan: Any = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict[str, str]:
        return {"state": self.state.value, "reason": self.reason}


@dataclass(frozen=True)
class Finding:
    """What `qosagent check` found on the host as it is now that the agent will meet: a warning, one line for the
    operator and its fields for `--json`; it changes neither the verdict nor check's exit status."""

    text: str
    fields: Mapping[str, Any] = field(default_factory=dict)


class CapabilityError(Exception):
    """A capability cannot start or went wrong in a way the daemon reports; message is for the operator."""


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Change:
    """A reload one capability has prepared against a new config: checked, nothing written yet.

    The daemon prepares every capability first and commits only when none refused, so a refusal leaves all of them
    on the old config. `commit` writes; when it fails part-way it puts back what it wrote and raises
    CapabilityError. `undo` puts the old config back after a commit that succeeded, when a later capability's
    commit failed."""

    commit: Callable[[], None] = _nothing
    undo: Callable[[], None] = _nothing


UNCHANGED = Change()

T = TypeVar("T")
S = TypeVar("S", bound=Service)


def rewrite(write: Callable[[T], None], new: T, old: T, what: str) -> Change:
    """The Change of a capability whose reload is one write of what a config makes of its state: new on commit,
    old on undo, and old back when the commit fails part-way (then CapabilityError naming `what`)."""

    def commit() -> None:
        try:
            write(new)
        except Exception as e:  # noqa: BLE001 - bcc, netlink and bpf() each raise their own kinds
            try:
                write(old)
            except Exception:  # noqa: BLE001 - the refusal below is what the operator must see
                logging.getLogger("qosagent").exception("putting the old %s back after a failed reload failed", what)
            raise CapabilityError(f"updating the {what} failed: {e}") from e

    return Change(commit, lambda: write(old))


@dataclass
class AgentContext:
    """What a capability may touch: the host through seams, never directly."""

    config: "Config"
    hostfs: HostFS
    gpu: "GpuBackend"
    clock: Callable[[], float] = time.monotonic
    # What one capability offers another, by a dotted name (e.g. "quota.limits" -> tenants.LimitsWriter), and the
    # agent's services (qosagent/services.py) by theirs, which capabilities ask for with service().
    services: dict[str, Any] = field(default_factory=dict)
    # The verdicts of the capabilities probed (and started, in the agent) before this one, by name: what a
    # capability may count on from another at probe, in `qosagent check` as in the agent.
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    # What each of them offers the others in `services` (Capability.offers), by the capability's name.
    offers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The tick's one GPU sample (the daemon takes it before maintain), for what a capability's maintain and collect
    # need of the GPUs; None before the first tick.
    gpu_state: "GpuState | None" = None
    # A clean stop hands enforcement over to the next agent where a capability can (quota's filter and pins stay);
    # True makes stop() remove everything, as `qosagent detach` would.
    detach_on_exit: bool = False
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("qosagent"))

    def record(self, kind: "type[Capability]", verdict: Verdict) -> None:
        """kind's verdict once probed (and started, in the agent), and what it offers the capabilities after it."""
        self.verdicts[kind.name] = verdict
        self.offers[kind.name] = kind.offers

    def offered(self, name: str) -> bool:
        """Whether a capability recorded before offers `name` in services and runs (in `qosagent check`, where
        nothing starts: would run)."""
        return any(name in offers and self.verdicts[cap].state in (State.ACTIVE, State.DEGRADED)
                   for cap, offers in self.offers.items())

    def service(self, kind: type[S]) -> S:
        """The agent's one `kind`, shared with every other capability that uses it (see Capability.uses)."""
        return services_mod.shared(self.services, kind, self.hostfs, self.clock)


class Capability:
    name: ClassVar[str]
    # The services (qosagent/services.py) it asks for: the daemon makes them before the first capability starts,
    # and stops them after the last one stops.
    uses: ClassVar[tuple[type[Service], ...]] = ()
    # What it offers other capabilities in AgentContext.services once started (their names: tenants.LIMITS_SERVICE).
    offers: ClassVar[tuple[str, ...]] = ()
    # Whether it loads BPF programs: the daemon then mounts tracefs, bpffs and cgroup2 where missing, before any
    # capability probes.
    loads_bpf: ClassVar[bool] = False

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.log = logging.getLogger(f"qosagent.{self.name}")
        self.verdict = Verdict(State.UNAVAILABLE, "not probed")

    @classmethod
    def enabled(cls, config: "Config") -> bool:
        return bool(getattr(config, cls.name).enabled)

    @classmethod
    def sandbox_needs(cls, config: "Config") -> list[Need]:
        """What this capability, enabled with `config`, needs of the sandbox it runs in (the unit, a container):
        the drop-in `qosagent check --systemd` prints, and what the daemon checks before it probes."""
        return []

    def probe(self, features: "Features") -> Verdict:
        """Whether this host supports the capability, and its plan for start; changes neither the host nor self."""
        raise NotImplementedError

    def begin(self, features: "Features") -> None:
        """Begin, before any capability starts, slow work of start's that needs nothing of the capabilities before
        it (a compile child: qosagent/ebpf/pinned.begin), so that it runs beside their starts; start waits for it.
        Changes nothing on the host that start would not."""

    def start(self, plan: Any = None) -> None:
        """Load, attach, save originals, as the probe's verdict planned (`plan`). Raise CapabilityError with an
        operator-facing message. The daemon sets self.verdict to the probe's before, and reports self.verdict after:
        start lowers it where it found less than probe promised (a program the kernel's verifier refused, hooks
        attached but never seen running) and carried on without it."""

    def maintain(self) -> None:
        """Periodic side effects (a heartbeat, re-listing what the kernel is told to watch, pruning links), each at
        its own cadence (schedule.Every): run by the daemon every tick before collect, so collect only reads."""

    def collect(self) -> Any:
        """This tick's immutable part of the Snapshot; reads only."""
        return None

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        """Pure: decisions from the snapshot and the capability's own previous decision state."""
        return []

    def apply(self, decisions: list[Decision]) -> None:
        """Write what was decided (nothing in dry-run)."""

    def quiet(self) -> bool:
        """After this tick's decide and apply: whether the tick found nothing new that a decision reads (no
        request timed, no tenant's count moved) and left nothing pending (no limit held, no streak building), so that
        what it decides next waits on new inputs alone and a slower loop (config rest_interval) would move no
        decision but in time.
        A capability that cannot say keeps the loop at `interval`."""
        return False

    def settled(self, part: Any) -> Any:
        """This tick's part as published once decide and apply have run, for metrics and status: the collected
        one, unless the part reports the capability's own decision, which then shows what the audit shows."""
        return part

    def prepare(self, config: "Config") -> Change:
        """Check a new, already validated config against what runs, writing nothing; raise CapabilityError to
        refuse it (the old config then stays everywhere). Keys marked RESTART in the schema never differ here.
        A capability that reads its config each tick has nothing to prepare."""
        return UNCHANGED

    def stop(self) -> None:
        """Undo everything start() and apply() did, in reverse; safe to call twice. Quota alone leaves its
        datapath for the next agent unless ctx.detach_on_exit (latency leaves its build pinned, attached
        nowhere, for the next agent to reuse)."""

    def kernel_maps(self, plan: Any) -> list["MapSize"]:
        """The BPF maps start would make for probe's plan, as `qosagent check` counts their kernel memory."""
        return []

    def findings(self, plan: Any) -> list[Finding]:
        """What `qosagent check` says of the host as it is now beyond the verdict, for probe's plan (run only where
        the verdict is active or degraded). Reads only, as probe does; the services it asks for are stopped after."""
        return []

    @classmethod
    def detach(cls, ctx: AgentContext) -> list[str]:
        """Without a running agent: remove what an agent of this capability left (a crash, `qosagent detach`).

        Returns one line per thing removed or restored."""
        return []

    def metrics(self, snapshot: Snapshot, shown: Container[str] = EVERYONE) -> Iterable["Metric"]:
        """Its families, from the snapshot; per-tenant series only for the tenants in `shown` (those with traffic
        within metrics.retention: qosagent/retention.py)."""
        return ()

    def traffic(self, snapshot: Snapshot) -> Mapping[str, tuple[int, ...]]:
        """Per tenant, counts that grow with its traffic (requests, connections, body writes), from which the exports
        tell who had traffic within metrics.retention; {} for a capability that counts none."""
        return {}

    def status(self, snapshot: Snapshot) -> dict[str, Any]:
        """JSON-able state for `qosagent status --json`."""
        return {}

    @staticmethod
    def render(status: dict[str, Any]) -> str:
        """Human text for this capability's status part (runs in the CLI, on the JSON)."""
        return ""

    @staticmethod
    def attention(status: dict[str, Any]) -> dict[str, Attention]:
        """Per tenant of this status part (runs in the CLI, on the JSON), what it says of the tenant's state:
        `qosagent status` shows the tenants that need it most first. {} for a capability that judges none."""
        return {}

