from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from qosagent.configbase import RESTART, Duration, Section

# A Kubernetes label key (optional DNS-subdomain prefix and a name) and value, as the API server accepts them.
LabelKey = Annotated[str, StringConstraints(
    pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}"
            r"[A-Za-z0-9])?$", max_length=316)]
LabelValue = Annotated[str, StringConstraints(pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")]


class PodMatch(Section):
    """tenants[].match.pods: the pods a tenant's serving namespaces belong to."""

    namespace: Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")] | None = None
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _something(self) -> "PodMatch":
        if self.namespace is None and not self.labels:
            raise ValueError("expected namespace, labels or both (a rule for every pod would claim the node)")
        return self


class PodsConfig(Section):
    """Where the pods of pods tenants are learned: the container runtime's CRI socket on this node."""

    # None: the first of /run/containerd/containerd.sock, /run/crio/crio.sock that answers (under --host-root).
    runtime_socket: Annotated[str | None, RESTART] = None
    refresh: Duration = 2.0  # how often the runtime's READY pod sandboxes are listed
    timeout: Duration = 1.0  # deadline of each call to the runtime
    # A list older than this (the runtime stopped answering) is no longer trusted: pods are unknown, and the
    # namespaces of pods tenants go back to the rules by port and address until the runtime answers again.
    stale_after: Duration = 30.0

    @model_validator(mode="after")
    def _order(self) -> "PodsConfig":
        if not 0.05 <= self.timeout <= self.refresh <= self.stale_after:
            raise ValueError("expected 50ms <= timeout <= refresh <= stale_after")
        return self
