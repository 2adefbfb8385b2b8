"""The config schema, its loading from YAML, and errors that name the file and the key path.

Each capability owns its section model (qosagent/<capability>/config.py); this module composes them and checks
what crosses sections (tiers named by tenants, ports claimed twice).
"""

from __future__ import annotations

import ipaddress
import re
from importlib import resources
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, StringConstraints, ValidationError, field_validator, model_validator

from qosagent.admission.config import AdmissionConfig
from qosagent.configbase import RESTART, REVALIDATE, Duration, Port, Regex, Section, duration_between
from qosagent.dvfs.config import DvfsConfig
from qosagent.fleet.config import FleetConfig
from qosagent.gpu.config import GpuConfig
from qosagent.latency.config import LatencyConfig
from qosagent.pods.config import PodMatch, PodsConfig
from qosagent.placement.config import PlacementConfig
from qosagent.quota.config import QuotaConfig
from qosagent.resources.config import ResourcesConfig, TierResources
from qosagent.servers.config import ServerConfig

# The name traffic gets when it is on a watched port but matches no tenant.
UNMATCHED = "unmatched"
# The tier of the unmatched traffic in status and metrics; no configured tier may take the name, or that traffic (the
# agent's own reads of a server's metrics, probes) would count in its SLO verdict.
UNMATCHED_TIER = "none"

Name = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]


class LimitSpec(Section):
    rps: float | None = Field(default=None, ge=0, description="new requests per second")
    burst: int | None = Field(default=None, ge=0, description="requests admitted at once above the rate")
    connections_per_s: float | None = Field(default=None, ge=0, description="new connections (SYN) per second")


class QuotaSpec(LimitSpec):
    # Across the fleet (fleet: section): request starts per second over every node, split by the allocator.
    fleet_rps: float | None = Field(default=None, ge=0, le=1e9, description="new requests per second, fleet-wide")
    fleet_burst: int | None = Field(default=None, ge=0, le=1 << 30, description="fleet-wide burst, split like the rate")


class TierConfig(Section):
    slo_p99: Duration
    weight: int = Field(ge=1, le=1000)
    quota: QuotaSpec | None = None
    floor: LimitSpec | None = None
    # May admission's pressure paths refuse this tier's new requests entirely (down to its floor, 0 without one)?
    # Otherwise no path takes a tenant of it below admission.min_rps (docs/admission.md, "Floors").
    sheddable: bool = False
    # The CPU, memory and scheduling its serving processes get (the resources capability).
    resources: TierResources | None = None

    def latency_sensitive(self) -> bool:
        """Whether its serving threads get the scheduler's latency hints: as configured, else an SLO under 500 ms."""
        r = self.resources
        if r is not None and r.latency_sensitive is not None:
            return r.latency_sensitive
        return (r is None or r.sched == "normal") and self.slo_p99 < 0.5

    def cpu_weight(self) -> int:
        """Its cgroups' CPU weight (v2 units): as configured, else 100 x its weight, at most 10000."""
        r = self.resources
        return r.cpu_weight if r is not None and r.cpu_weight is not None else min(10000, 100 * self.weight)


class HeaderMatch(Section):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9-]{1,64}$")]
    value: Annotated[str, StringConstraints(min_length=1, max_length=64)]


class TenantMatch(Section):
    ports: list[Port] = Field(default_factory=list)
    cidrs: list[str] = Field(default_factory=list)
    header: HeaderMatch | None = None
    # Requests into the network namespace of a serving process whose command line this regex finds (a pod), on
    # `ports` (default: every watched port): quota by the host-side veth, latency by the namespace's addresses.
    process: Regex | None = None
    # Requests into the network namespace of a pod the container runtime lists (namespace, labels), on `ports`
    # (default: every watched port). One listing of the runtime serves quota and latency (docs/configuration.md).
    pods: PodMatch | None = None

    @property
    def per_namespace(self) -> bool:
        """Matched per serving network namespace (process, pods): quota_netns and lat_netns, not the shared maps."""
        return self.process is not None or self.pods is not None

    @property
    def claims_ports(self) -> bool:
        """Ports alone claim every connection on them, in every network namespace."""
        return bool(self.ports) and not self.cidrs and not self.header and not self.per_namespace

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        out = []
        for c in v:
            try:
                out.append(str(ipaddress.ip_network(c, strict=False)))
            except ValueError:
                raise ValueError(f"not an IPv4 or IPv6 network: {c!r}") from None
        return out


class TenantConfig(Section):
    name: Name
    tier: str
    match: TenantMatch
    quota: QuotaSpec | None = None


class MetricsTls(Section):
    cert_file: str = Field(description="PEM certificate (chain) served on the metrics listener")
    key_file: str = Field(description="PEM private key of cert_file")
    # Client certificates: "require" (and verify) makes /metrics answer only scrapers holding a certificate that
    # client_ca_file signed; "verify_if_given" verifies one when a client offers it.
    client_auth: Literal["none", "verify_if_given", "require"] = "none"
    client_ca_file: str | None = None

    @model_validator(mode="after")
    def _client_ca(self) -> "MetricsTls":
        if self.client_auth != "none" and not self.client_ca_file:
            raise ValueError(f"client_auth {self.client_auth} needs client_ca_file")
        return self


class MetricsBasicAuth(Section):
    username: Annotated[str, StringConstraints(min_length=1, pattern=r"^[^:]+$")]
    password_file: str | None = Field(default=None, description="file holding the password (one line)")
    password_hash: str | None = Field(default=None, description="bcrypt hash of the password ($2b$...)")

    @model_validator(mode="after")
    def _one_secret(self) -> "MetricsBasicAuth":
        if (self.password_file is None) == (self.password_hash is None):
            raise ValueError("expected exactly one of password_file, password_hash")
        if self.password_hash is not None and not re.fullmatch(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}",
                                                                self.password_hash):
            raise ValueError("password_hash is not a bcrypt hash ($2b$<cost>$<53 characters>)")
        return self


class MetricsConfig(Section):
    enabled: bool = True
    listen: str = "127.0.0.1:9464"
    # /metrics only: kubelet probes and load balancers reach /healthz and /readyz without credentials.
    tls: MetricsTls | None = None
    basic_auth: MetricsBasicAuth | None = None
    # Instead of tls and basic_auth: a web config file in the shape of Prometheus' exporter-toolkit
    # (tls_server_config, basic_auth_users), as node_exporter's --web.config.file takes.
    web_config_file: str | None = None
    # /healthz and /readyz alone, in plain HTTP on their own address: probes need neither TLS nor credentials.
    health_listen: str | None = None
    # The latency families' names before 0.2.0 grouped them under qosagent_latency_, exposed beside the new ones
    # when on (qosagent/latency/export.py, RENAMED); off since they doubled every per-tenant family, 0.3.0 removes them.
    deprecated_names: bool = False
    # A tenant's series are written while it has had traffic within this long (qosagent/retention.py): an idle
    # tenant costs nothing per scrape, and comes back with its counts since start. Longer than the longest range
    # a rule or dashboard takes rate() over, so a tenant's last increase is still seen.
    retention: duration_between(30.0, 30 * 86400.0, "30s and 30d") = 600.0  # type: ignore[valid-type]

    @field_validator("listen", "health_listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "MetricsConfig":
        if self.web_config_file and (self.tls or self.basic_auth):
            raise ValueError("web_config_file replaces tls and basic_auth: set one or the other")
        return self


class StatusConfig(Section):
    socket: str = "/run/qosagent/status.sock"
    decisions_kept: int = Field(default=1000, ge=10, le=100000)


class BpfConfig(Section):
    # Versioned below this path so that an agent of another layout never adopts incompatible pins.
    pin_root: str = "/sys/fs/bpf/qosagent"


class ConfigWatchConfig(Section):
    # A change of the file given with --config (an edit, a ConfigMap update) reloads as SIGHUP does.
    enabled: bool = True
    interval: duration_between(0.1, 3600.0, "100ms and 1h") = 5.0  # type: ignore[valid-type]


class ReadinessConfig(Section):
    # Capabilities that may be unavailable or degraded while /readyz still answers ready; every other enabled one
    # must be active.
    optional: list[Literal["latency", "quota", "admission", "fleet", "dvfs", "placement", "resources"]] = Field(
        default_factory=list)


def _default_tiers() -> dict[str, TierConfig]:
    return {
        "gold": TierConfig(slo_p99="120ms", weight=10),  # type: ignore[arg-type]
        "silver": TierConfig(slo_p99="350ms", weight=5),  # type: ignore[arg-type]
        "bronze": TierConfig(slo_p99="1200ms", weight=1),  # type: ignore[arg-type]
    }


class Config(Section):
    interval: Duration = 0.1
    # The loop's period once its ticks have been quiet for this long (schedule.Pace); back to `interval` at the first
    # tick that is not. At most `interval`: never resting. At most 1 s: a rate over the last second read in the
    # second after the loop wakes spans up to 1 s + rest_interval (docs/configuration.md).
    rest_interval: duration_between(0.0, 1.0, "0 and 1s") = 0.5  # type: ignore[valid-type]
    # Keys marked RESTART are read once at start (a reload that changes one is refused, naming it).
    log_level: Annotated[str, RESTART] = Field(default="info", pattern="^(debug|info|warning|error)$")
    state_dir: Annotated[str, RESTART] = "/run/qosagent"
    metrics: Annotated[MetricsConfig, RESTART] = MetricsConfig()
    status: Annotated[StatusConfig, RESTART] = StatusConfig()
    bpf: Annotated[BpfConfig, RESTART] = BpfConfig()
    readiness: ReadinessConfig = ReadinessConfig()
    config_watch: ConfigWatchConfig = ConfigWatchConfig()
    gpu: Annotated[GpuConfig, RESTART] = GpuConfig()
    tiers: dict[Name, TierConfig] = Field(default_factory=_default_tiers)
    tenants: list[TenantConfig] = Field(default_factory=list)
    pods: PodsConfig = PodsConfig()  # where tenants that match pods learn them (docs/configuration.md)
    # The inference servers admission reads (KV cache, queue). None: those found listening on the watched ports;
    # an empty list: none (docs/servers.md).
    servers: Annotated[list[ServerConfig] | None, RESTART] = None
    latency: LatencyConfig = LatencyConfig()
    quota: QuotaConfig = QuotaConfig()
    admission: AdmissionConfig = AdmissionConfig()
    dvfs: DvfsConfig = DvfsConfig()
    placement: PlacementConfig = PlacementConfig()
    fleet: FleetConfig = FleetConfig()
    resources: ResourcesConfig = ResourcesConfig()

    @field_validator("interval")
    @classmethod
    def _interval(cls, v: float) -> float:
        if not 0.01 <= v <= 60:
            raise ValueError("expected between 10ms and 60s")
        return v

    def tier_of(self, tenant: TenantConfig) -> TierConfig:
        return self.tiers[tenant.tier]

    def watched_ports(self) -> list[int]:
        """The watched ports: latency.ports and the tenants' ports. Their requests are timed and, with quota on,
        classified (the quota map `watched_ports`); inference servers are looked for on them."""
        ports = set(self.latency.ports)
        for t in self.tenants:
            ports.update(t.match.ports)
        return sorted(ports)

    def tracked_ports(self) -> list[int]:
        """The tracked ports: the watched ports and latency.multiplexed_ports. Latency tracks the connections on them
        (those on multiplexed ports counted, not timed), and a network namespace where one listens is a serving
        one (netns)."""
        return sorted(set(self.watched_ports()) | set(self.latency.multiplexed_ports))


def with_metrics(cfg: Config, overrides: dict[str, str | None]) -> Config:
    """cfg with metrics keys set from the command line (`qosagent run --metrics-listen ...`), validated as the file's
    would be. The agent applies the same to every config it reloads, so they never count as a restart-only change."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return cfg
    metrics = MetricsConfig.model_validate({**cfg.metrics.model_dump(), **given}, context=REVALIDATE)
    return cfg.model_copy(update={"metrics": metrics})


class ConfigError(Exception):
    """A config that cannot be used: names the source and each offending key path."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(f"{self.source}: {path or '(top level)'}: {msg}" for path, msg in self.problems)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "missing required key"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind not in ("value_error",) and "input" in err and not isinstance(err["input"], (dict, list)):
        msg += f" (got {err['input']!r})"
    return msg


def _cross_checks(cfg: Config) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    port_owner: dict[int, str] = {}
    if UNMATCHED_TIER in cfg.tiers:
        problems.append((f"tiers.{UNMATCHED_TIER}", f"{UNMATCHED_TIER!r} is reserved: the tier of the traffic that "
                                                    "matches no tenant"))
    for i, t in enumerate(cfg.tenants):
        here = f"tenants[{i}]"
        if t.name == UNMATCHED:
            problems.append((f"{here}.name", f"{UNMATCHED!r} is reserved for traffic that matches no tenant"))
        if t.name in seen:
            problems.append((f"{here}.name", f"duplicate tenant name (first at tenants[{seen[t.name]}])"))
        seen.setdefault(t.name, i)
        if t.tier not in cfg.tiers:
            problems.append((f"{here}.tier", f"unknown tier {t.tier!r}; expected one of {sorted(cfg.tiers)}"))
        m = t.match
        if not (m.ports or m.cidrs or m.header or m.per_namespace):
            problems.append((f"{here}.match", "expected at least one of ports, cidrs, header, process, pods"))
        if m.process is not None and (m.cidrs or m.header):
            problems.append((f"{here}.match.process", "cannot be combined with cidrs or header"))
        if m.pods is not None and (m.cidrs or m.header or m.process is not None):
            problems.append((f"{here}.match.pods", "cannot be combined with cidrs, header or process"))
        if m.pods is not None and cfg.quota.enabled and not cfg.quota.namespaces:
            # The agent learns the pods whichever capability runs (latency attributes them by address); quota
            # classifies a pod's requests only in the serving namespaces it follows: without them it enforces nothing.
            problems.append((f"{here}.match.pods", "needs quota.namespaces while quota is enabled (quota classifies "
                             "a pod's requests at the host-side veths of the serving network namespaces it follows)"))
        # A port alone claims every connection on it; two tenants cannot both claim one.
        if m.claims_ports:
            for p in m.ports:
                if p in port_owner:
                    problems.append((f"{here}.match.ports", f"port {p} is already claimed by {port_owner[p]!r}"))
                port_owner.setdefault(p, t.name)
    server_ports: dict[int, int] = {}
    for i, srv in enumerate(cfg.servers or []):
        if srv.port in server_ports:
            problems.append((f"servers[{i}].port", f"port {srv.port} is already servers[{server_ports[srv.port]}]"))
        server_ports.setdefault(srv.port, i)
    for i, t in enumerate(cfg.tenants):
        for p in t.match.ports if t.match.per_namespace else []:
            if p in port_owner:
                problems.append((f"tenants[{i}].match.ports", f"port {p} is claimed by {port_owner[p]!r} in every "
                                 f"network namespace; a {'pods' if t.match.pods else 'process'} tenant cannot "
                                 "share it"))
    if cfg.fleet.enabled and not cfg.quota.enabled:
        problems.append(("fleet.enabled", "needs quota.enabled (fleet grants are enforced by the quota classifier)"))
    tenants = {t.name for t in cfg.tenants}
    for i, sel in enumerate(cfg.placement.selectors):
        if sel.tenant is not None and sel.tenant not in tenants:
            problems.append((f"placement.selectors[{i}].tenant", f"unknown tenant {sel.tenant!r}"))
    for tier in cfg.placement.exclusive_cpus:
        if tier not in cfg.tiers:
            problems.append((f"placement.exclusive_cpus.{tier}", f"unknown tier; expected one of {sorted(cfg.tiers)}"))
    return problems


def parse(data: Any, source: str) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, [("", "expected a mapping of config keys")])
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, [(_loc_to_path(err["loc"]), _message(err)) for err in e.errors()]) from None
    problems = _cross_checks(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg


# libyaml's parser where PyYAML was built with it (Debian's python3-yaml, the wheels): the pure-Python one takes
# about 2 s for 4,000 tenants, a quarter of that here.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_text(text: str, source: str) -> Config:
    try:
        data = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(source, [(where, f"invalid YAML: {getattr(e, 'problem', None) or e}")]) from None
    return parse(data, source)


DEFAULT_SOURCE = "<embedded default>"


def default_text() -> str:
    return resources.files("qosagent").joinpath("default.yaml").read_text()


def load(path: str | None) -> Config:
    """The config at path, or the embedded default (observe only) when path is None."""
    if path is None:
        return parse_text(default_text(), DEFAULT_SOURCE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(path, [("", f"cannot read: {e.strerror}")]) from None
    return parse_text(text, path)
