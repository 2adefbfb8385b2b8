from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, HttpUrl, model_validator

from qosagent.configbase import RESTART, Duration, Mode, Section


class PreCleanupConfig(Section):
    """What runs once when a GPU enters memory pressure (e.g. ask the server to drop its prefix cache).

    Exactly one of command (argv, run without a shell) or http_post (a URL posted to with an empty body)."""

    command: list[str] | None = Field(default=None, min_length=1)
    http_post: HttpUrl | None = None
    timeout: Duration = 5.0

    @model_validator(mode="after")
    def _one_action(self) -> "PreCleanupConfig":
        if (self.command is None) == (self.http_post is None):
            raise ValueError("expected exactly one of command, http_post")
        if not 0 < self.timeout <= 300:
            raise ValueError("timeout: expected between 0s and 5m")
        return self


class GpuPressureConfig(Section):
    """Shedding the sheddable tiers while a GPU's memory is nearly full, where memory is the evidence: only on GPUs
    that no server with a reading may use (docs/admission.md, "GPU memory: evidence first")."""

    # GPU indices that serve the tenants; empty means every GPU the backend reports.
    gpus: list[int] = Field(default_factory=list)
    enter: float = Field(default=0.90, gt=0, le=1, description="memory used ratio above which shedding starts")
    exit: float = Field(default=0.85, gt=0, le=1, description="memory used ratio below which shedding ends")
    # growth: memory counts once it has grown past `enter` from at or below `exit` while the agent watched (a
    # pre-allocating server's reservation is there from the first reading and never counts); level: over `enter`
    # counts whatever it started at, for hosts where the operator knows memory is load.
    trigger: Literal["growth", "level"] = "growth"
    # While a GPU stays above `enter`, one more tier is shed after each escalate_after.
    escalate_after: Duration = 5.0
    pre_cleanup: PreCleanupConfig | None = None

    @model_validator(mode="after")
    def _hysteresis(self) -> "GpuPressureConfig":
        if self.exit >= self.enter:
            raise ValueError("exit must be below enter, or shedding would flap")
        return self


class ServerPressureConfig(Section):
    """Pressure as the inference servers report it (servers:): KV cache nearly full, or a queue that stays long."""

    kv_enter: float = Field(default=0.95, gt=0, le=1, description="KV-cache usage above which the server is pressed")
    kv_exit: float = Field(default=0.85, gt=0, le=1, description="KV-cache usage below which that pressure ends")
    queue_enter: int = Field(default=16, ge=1, description="requests waiting above which, for queue_ticks ticks, "
                             "the server is pressed")
    queue_ticks: int = Field(default=10, ge=1, le=10000)
    queue_exit: int = Field(default=4, ge=0, description="requests waiting at or below which that pressure ends")
    # While a server stays pressed, the next cut (lowest tier with headroom first) after this long.
    cut_every: Duration = 2.0

    @model_validator(mode="after")
    def _hysteresis(self) -> "ServerPressureConfig":
        if self.kv_exit >= self.kv_enter:
            raise ValueError("kv_exit must be below kv_enter, or limits would flap")
        if self.queue_exit >= self.queue_enter:
            raise ValueError("queue_exit must be below queue_enter, or limits would flap")
        return self


class AdmissionConfig(Section):
    enabled: Annotated[bool, RESTART] = False
    mode: Mode = "dry-run"
    # Which latency the SLO is held against (docs/latency.md): time to first token (the first response body byte,
    # what streaming clients wait for), to the response headers, or to the last response byte. Status, metrics and
    # the alert rules judge the SLO on the same signal and quantile.
    signal: Literal["ttft", "headers", "response"] = "ttft"
    quantile: float = Field(default=0.95, ge=0.5, le=0.999)
    breach_ticks: int = Field(default=3, ge=1, le=1000)
    healthy_ticks: int = Field(default=10, ge=1, le=10000)
    # A tier is healthy below healthy_below x SLO, near its SLO at or above near_slo x SLO.
    healthy_below: float = Field(default=0.9, gt=0, le=1)
    near_slo: float = Field(default=0.8, gt=0, le=1)
    cut: Literal["multiplicative", "gradient"] = "multiplicative"
    cut_factor: float = Field(default=0.7, gt=0, lt=1)
    raise_step: float = Field(default=0.10, gt=0, le=1)
    cooldown: Duration = 5.0
    # Where latency and server-pressure cuts stop for a tier without a floor (a tier's floor, where set, is where
    # they stop): a cut must never black-hole a tenant. GPU shedding touches only sheddable tiers, down to their floor.
    min_rps: float = Field(default=1.0, gt=0)
    gpu_pressure: GpuPressureConfig = GpuPressureConfig()
    server_pressure: ServerPressureConfig = ServerPressureConfig()
