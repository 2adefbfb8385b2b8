from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from qosagent.configbase import RESTART, Duration, Section


class QuotaConfig(Section):
    enabled: Annotated[bool, RESTART] = False
    # Ingress of these interfaces is classified; empty: lo and every interface holding an address that a listener on
    # a watched port is bound to (all interfaces with an address when it listens on the wildcard).
    interfaces: list[str] = Field(default_factory=list)
    # Adaptive limits (from admission) are honoured in the kernel only while the agent's heartbeat is younger than
    # this; then the configured baseline applies again, so a dead agent never leaves a tenant shed.
    # Also classify requests into the network namespaces where a tracked port listens (pods): on the egress of each
    # host-side veth into one, followed as namespaces come and go.
    namespaces: bool = True
    heartbeat_timeout: Duration = 5.0
    # The agent's own place on the ingress hook; filters of others are never touched.
    tc_prio: Annotated[int, RESTART] = Field(default=3082, ge=1, le=0xFFFF)
    tc_handle: Annotated[int, RESTART] = Field(default=0x51A, ge=1, le=0xFFFFFFFF)
    flow_entries: Annotated[int, RESTART] = Field(default=65536, ge=1024, le=1 << 22)
    # Bytes of a request's first segment searched for a tenant header.
    header_scan_bytes: Annotated[Literal[256, 512, 1024], RESTART] = 512
