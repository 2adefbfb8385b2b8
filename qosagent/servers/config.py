"""The `servers:` list: the inference servers whose own metrics admission reads (docs/servers.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, HttpUrl, model_validator

from qosagent.configbase import Duration, Port, Section

Kind = Literal["auto", "vllm", "tgi", "triton", "sglang", "llamacpp", "generic"]


class ServerConfig(Section):
    port: Port = Field(description="the port the server answers inference requests on")
    # Default http://127.0.0.1:<port>/metrics; Triton serves its metrics on 8002, which its kind knows.
    metrics: HttpUrl | None = None
    # auto: from the listening process's command line, else from the metric names the server exports.
    kind: Kind = "auto"
    interval: Duration = Field(default=1.0, description="how often the metrics are read")
    timeout: Duration = Field(default=0.5, description="one read, connect to last byte; a slower one fails")
    # A reading older than this is unknown: nothing is decided on it.
    stale_after: Duration = 5.0

    @model_validator(mode="after")
    def _times(self) -> "ServerConfig":
        if not 0.05 <= self.interval <= 60:
            raise ValueError("interval: expected between 50ms and 60s")
        if not 0 < self.timeout <= self.interval:
            raise ValueError("timeout: expected above 0 and at most interval (reads never overlap)")
        if self.stale_after < 2 * self.interval:
            raise ValueError("stale_after: expected at least twice interval, or one late read makes it unknown")
        return self
