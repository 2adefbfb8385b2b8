"""The agent's capabilities and services, as the daemon and `qosagent check`, `detach` and `status` read them: the
composition root's one list. Only the layer above the capabilities imports this (daemon, cli, status); the faces
they implement (capability.py, services.py) know none of them."""

from __future__ import annotations

from typing import Iterable

from qosagent.admission.capability import Admission
from qosagent.capability import Capability
from qosagent.config import Config
from qosagent.dvfs.capability import Dvfs
from qosagent.fleet.capability import Fleet
from qosagent.latency.capability import Latency
from qosagent.placement.capability import Placement
from qosagent.quota.capability import Quota
from qosagent.resources.capability import Resources
from qosagent.sandbox import Need
from qosagent.servers.capability import Servers
from qosagent.services import Service

# In start and tick order: measurement first, then the ones that decide on it. Quota starts before latency because
# latency reads quota's pinned flow map (header-matched tenants); servers (readings only) before admission, which
# decides on them; fleet after quota, whose maps hold its shares; resources before admission, whose latency cuts
# wait while resources can still take CPU from the tiers below (ResourcesPart.cpu_held).
CAPABILITIES: tuple[type[Capability], ...] = (Quota, Latency, Servers, Resources, Admission, Fleet, Dvfs, Placement)


def services(kinds: Iterable[type[Capability]]) -> list[type[Service]]:
    """The services these capabilities use, each once, in the order they first use them."""
    return list(dict.fromkeys(s for k in kinds for s in k.uses))


def enabled(config: Config, kinds: Iterable[type[Capability]] | None = None) -> list[type[Capability]]:
    return [k for k in (CAPABILITIES if kinds is None else kinds) if k.enabled(config)]


def sandbox_needs(config: Config) -> dict[str, list[Need]]:
    """What each enabled capability needs of the sandbox, by its name, for the drop-in (sandbox.dropin)."""
    return {k.name: needs for k in enabled(config) if (needs := k.sandbox_needs(config))}
