"""What each tenant of a config will match, as `qosagent check` reports it: the traffic (ports × client networks ×
header × process or pods), the programs that see it, and the rules that make part or all of it someone else's.

Pure over the config. The order of the rules is the datapath's (bpf/include/qos_tenant.h): a port claimed by a
ports-only tenant first; then the serving network namespace (process, pods); then the client address, longest
prefix first, among the networks bound to that port and then among those bound to every watched port; then (the
TC classifier only) an HTTP/1.x header.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from qosagent.config import Config, TenantConfig

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class TenantReport:
    tenant: str
    tier: str
    ports: list[int]
    # "match.ports" when the tenant names its ports, else "watched" (every watched port).
    ports_from: str
    clients: list[str]  # ["any"], or the tenant's networks
    header: str | None
    namespace_rule: str | None  # "process /regex/" or "pods namespace=… labels=…"
    seen_by: list[str]
    # Ports on which this tenant can match nothing, with the reason (another tenant's rule comes first).
    shadowed: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def matches_nothing(self) -> bool:
        return not self.seen_by or set(self.shadowed) >= set(self.ports)

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "tier": self.tier, "ports": self.ports, "ports_from": self.ports_from,
                "clients": self.clients, "header": self.header, "namespace_rule": self.namespace_rule,
                "seen_by": self.seen_by, "shadowed": {str(p): t for p, t in sorted(self.shadowed.items())},
                "matches_nothing": self.matches_nothing(), "warnings": self.warnings}


def _namespace_rule(t: TenantConfig) -> str | None:
    m = t.match
    if m.process is not None:
        return f"process /{m.process}/"
    if m.pods is not None:
        parts = ([f"namespace={m.pods.namespace}"] if m.pods.namespace else []) + [
            f"{k}={v}" for k, v in sorted(m.pods.labels.items())]
        return "pods " + " ".join(parts)
    return None


def _seen_by(cfg: Config, t: TenantConfig) -> tuple[list[str], list[str]]:
    """The programs that attribute this tenant's traffic, and why the others do not."""
    seen, why = [], []
    if t.match.header is not None:
        # Only the classifier sees payload; latency takes header tenants from quota's flow table.
        if cfg.quota.enabled:
            seen += ["quota", "latency"] if cfg.latency.enabled else ["quota"]
        else:
            why.append("a header is read only by quota's classifier, and quota is off")
        return seen, why
    if cfg.latency.enabled:
        seen.append("latency")
    if cfg.quota.enabled:
        seen.append("quota")
    if not seen:
        why.append("latency and quota are both off")
    return seen, why


def _networks(t: TenantConfig) -> list[Network]:
    return [ipaddress.ip_network(c, strict=False) for c in t.match.cidrs]


def tenant_reports(cfg: Config) -> list[TenantReport]:
    watched = cfg.watched_ports()
    claimed = {p: t.name for t in cfg.tenants if t.match.claims_ports for p in t.match.ports}
    reports: dict[str, TenantReport] = {}
    for t in cfg.tenants:
        m = t.match
        seen, why = _seen_by(cfg, t)
        r = TenantReport(
            tenant=t.name, tier=t.tier, ports=sorted(m.ports) if m.ports else list(watched),
            ports_from="match.ports" if m.ports else "watched",
            clients=list(m.cidrs) or ["any"], header=f"{m.header.name}: {m.header.value}" if m.header else None,
            namespace_rule=_namespace_rule(t), seen_by=seen, warnings=list(why))
        if not r.ports:
            r.warnings.append("no port is watched (latency.ports is empty and no tenant names a port)")
        if not m.claims_ports:
            for p in r.ports:
                if p in claimed:
                    r.shadowed[p] = f"tenant {claimed[p]} claims it by port alone"
        if m.header is not None:
            for p in sorted(set(r.ports) & set(cfg.latency.multiplexed_ports)):
                r.shadowed.setdefault(p, "a multiplexed port (HTTP/2): its headers are not read")
        reports[t.name] = r
    _overlaps(cfg, reports)
    for r in reports.values():
        r.warnings += [f"port {p}: {why}" for p, why in sorted(r.shadowed.items())]
        if r.matches_nothing():
            r.warnings.insert(0, "matches nothing")
    return list(reports.values())


def _overlaps(cfg: Config, reports: dict[str, TenantReport]) -> None:
    """Client networks two tenants both name on a port: the longer prefix wins where they nest, and for the same
    network on the same port the tenant listed later takes it all (its map entry replaces the other's). A header
    tenant's clients that a network tenant names on the same port are that tenant's (addresses come first)."""
    by_cidr = [t for t in cfg.tenants if t.match.cidrs]
    for i, a in enumerate(by_cidr):
        for b in by_cidr[i + 1:]:
            common = sorted(set(reports[a.name].ports) & set(reports[b.name].ports))
            if not common:
                continue
            # Port-bound networks are looked up before those bound to every watched port.
            a_any, b_any = not a.match.ports, not b.match.ports
            for na in _networks(a):
                for nb in _networks(b):
                    if na.version != nb.version or not (na.subnet_of(nb) or nb.subnet_of(na)):  # type: ignore[arg-type]
                        continue
                    ports = ", ".join(map(str, common))
                    if na == nb and a_any == b_any:
                        reports[a.name].warnings.append(
                            f"clients {na} on port {ports} are {b.name}'s (listed later, same network)")
                        reports[b.name].warnings.append(f"overlaps {a.name}: same clients {na} on port {ports}")
                    else:
                        reports[a.name].warnings.append(f"overlaps {b.name}: {na} and {nb} on port {ports}")
                        reports[b.name].warnings.append(f"overlaps {a.name}: {nb} and {na} on port {ports}")
    for h in (t for t in cfg.tenants if t.match.header is not None):
        for n in by_cidr:
            common = sorted(set(reports[h.name].ports) & set(reports[n.name].ports))
            if common and n.name != h.name:
                nets = ", ".join(n.match.cidrs)
                reports[h.name].warnings.append(
                    f"requests from {nets} on port {', '.join(map(str, common))} are {n.name}'s before any header "
                    "is read")


def render(reports: list[TenantReport]) -> str:
    if not reports:
        return "TENANT  no tenants: all traffic on the watched ports is unmatched"
    rows = [("TENANT", "TIER", "PORTS", "CLIENTS", "ALSO", "SEEN BY")]
    for r in reports:
        ports = ",".join(map(str, r.ports)) + (" (watched)" if r.ports_from == "watched" else "")
        also = "; ".join(x for x in (r.header and f"header {r.header}", r.namespace_rule) if x) or "-"
        rows.append((r.tenant, r.tier, ports or "-", ",".join(r.clients), also, ",".join(r.seen_by) or "nothing"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    for r in reports:
        lines += [f"warning: tenant {r.tenant}: {w}" for w in r.warnings]
    return "\n".join(lines)
