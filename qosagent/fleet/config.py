from __future__ import annotations

import socket
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from qosagent.configbase import RESTART, Duration, Section


class FleetConfig(Section):
    """Fleet-wide tenant quotas (docs/fleet.md): agents report demand to etcd and enforce the per-node rate the
    elected allocator grants them, on a lease."""

    enabled: Annotated[bool, RESTART] = False
    engine: Annotated[Literal["etcd"], RESTART] = "etcd"
    # etcd client URLs (its v3 JSON gateway: http://HOST:2379); tried in order, the next on a failure.
    endpoints: Annotated[list[str], RESTART] = Field(default_factory=lambda: ["http://127.0.0.1:2379"])
    node: Annotated[str | None, RESTART] = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$")
    prefix: Annotated[str, RESTART] = Field(default="/qosagent", pattern=r"^/[A-Za-z0-9_./-]{0,200}$")
    report_interval: Duration = 1.0
    lease: Duration = 5.0
    # The fraction of a tenant's fleet quota a node enforces without a live grant; default 1/expected_nodes.
    safe_share: float | None = Field(default=None, gt=0, le=1)
    expected_nodes: int | None = Field(default=None, ge=1, le=100000)
    # The fleet's capacity: the most new requests per second granted over every tenant with a fleet quota
    # together; when demand is above it, tiers are served by weight (docs/fleet.md, "Tiers"). None: no such
    # bound, each tenant has its own fleet_rps whatever the others do.
    capacity_rps: float | None = Field(default=None, gt=0)

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("expected at least one etcd URL")
        for u in v:
            if not (u.startswith("http://") or u.startswith("https://")):
                raise ValueError(f"expected an http:// or https:// URL, got {u!r}")
        return [u.rstrip("/") for u in v]

    @model_validator(mode="after")
    def _timing(self) -> "FleetConfig":
        if not 0.05 <= self.report_interval <= 60:
            raise ValueError("report_interval: expected between 50ms and 60s")
        # A grant is renewed every report interval: a lease of fewer than two would expire on one late round.
        if self.lease < 2 * self.report_interval:
            raise ValueError(f"lease: expected at least twice report_interval ({2 * self.report_interval:g}s)")
        if self.enabled and self.safe_share is None and self.expected_nodes is None:
            raise ValueError("expected safe_share or expected_nodes (the safe share defaults to 1/expected_nodes)")
        return self

    @property
    def node_name(self) -> str:
        return self.node or socket.gethostname()

    @property
    def share_when_unleased(self) -> float:
        if self.safe_share is not None:
            return self.safe_share
        return 1.0 / (self.expected_nodes or 1)
