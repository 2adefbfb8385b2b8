from __future__ import annotations

from pydantic import Field

from qosagent.configbase import Duration, Port, Section


class RunqueueConfig(Section):
    enabled: bool = True


class LatencyConfig(Section):
    enabled: bool = True
    # vLLM and Triton HTTP serve on 8000 (Triton gRPC on 8001), TGI on 8080 in its container and 3000 by default
    # when launched by hand. Sockets on these ports are measured even when no tenant claims them ("unmatched").
    ports: list[Port] = Field(default_factory=lambda: [8000, 8001, 8080, 3000])
    window: Duration = 10.0
    runqueue: RunqueueConfig = RunqueueConfig()
