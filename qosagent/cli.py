"""qosagent's command line: run, check, status, reload, detach, allocator (and capability commands such as
topology).

Each command imports what it runs inside its function: `qosagent reload` or `--help` must not load the agent
(every capability, prometheus_client, the BPF loader) to send one request or print a page.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import Any, Callable

import click

from qosagent import __version__
from qosagent import config as config_mod
from qosagent import matchreport
from qosagent.hostfs import HostFS

EXIT_CONFIG = 2
EXIT_NO_AGENT = 3
EXIT_KERNEL = 4  # the kernel cannot run what the config enables: restarting cannot fix it either


def host_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--host-root", default="/", show_default=True, type=click.Path(file_okay=False),
                     help="Where the host's / is mounted (/host in a DaemonSet); all /sys and /proc reads go there.")(f)
    f = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                     help="YAML config; without it the embedded default (observe only) is used.")(f)
    return f


def listener_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """What the metrics listener asks of clients, for run and allocator alike."""
    f = click.option("--web-config-file", envvar="QOSAGENT_WEB_CONFIG_FILE", default=None, metavar="FILE",
                     help="Overrides metrics.web_config_file: TLS, client certificates and basic auth users in "
                          "exporter-toolkit's web config shape. [env: QOSAGENT_WEB_CONFIG_FILE]")(f)
    f = click.option("--health-listen", envvar="QOSAGENT_HEALTH_LISTEN", default=None, metavar="HOST:PORT",
                     help="Overrides metrics.health_listen: /healthz and /readyz alone, in plain HTTP, for probes. "
                          "[env: QOSAGENT_HEALTH_LISTEN]")(f)
    return f


def load_config(path: str | None) -> config_mod.Config:
    try:
        return config_mod.load(path)
    except config_mod.ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(EXIT_CONFIG)


def _refuse_old_kernel(cfg: config_mod.Config) -> None:
    """Exit with one line when an enabled capability loads BPF programs and this kernel's verifier lacks the atomic
    operations they are compiled to (before 5.12): otherwise each program would compile for seconds and end in the
    verifier's "BPF_STX uses reserved fields". A kernel that will not say (no privilege to ask) is not refused."""
    from qosagent import capabilities
    from qosagent.ebpf import atomics

    loaders = [k.name for k in capabilities.enabled(cfg) if k.loads_bpf]
    if loaders and atomics.supported() == "no":
        names = " and ".join(loaders)
        click.echo(f"kernel {platform.release()} has no {atomics.REFUSAL}, which {names} need: run a 5.12 or newer "
                   f"kernel, or disable {names}", err=True)
        sys.exit(EXIT_KERNEL)


def sd_notify(state: str) -> None:
    """systemd's notify protocol (one datagram), a no-op outside a Type=notify unit."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError:
            pass


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qosagent")
def main() -> None:
    """Keep inference tenants inside their latency SLOs: eBPF latency per tenant, in-kernel quotas,
    SLO-driven limits, DVFS, NUMA placement and per-tier CPU and memory (cgroups, scheduler hints), with Prometheus
    metrics and an audit of every decision."""


@main.command()
@host_options
@click.option("--detach-on-exit", is_flag=True, envvar="QOSAGENT_DETACH_ON_EXIT",
              help="On SIGTERM/SIGINT remove the quota filter and pins too (for uninstalling). Without it they stay "
                   "enforcing for the next agent (an upgrade or restart leaves no gap); `qosagent detach` removes "
                   "them later. [env: QOSAGENT_DETACH_ON_EXIT]")
@click.option("--metrics-listen", envvar="QOSAGENT_METRICS_LISTEN", default=None, metavar="HOST:PORT",
              help="Overrides metrics.listen (the DaemonSet binds the node's own IP). [env: QOSAGENT_METRICS_LISTEN]")
@listener_options
def run(config_path: str | None, host_root: str, detach_on_exit: bool, metrics_listen: str | None,
        health_listen: str | None, web_config_file: str | None) -> None:
    """Run the agent in the foreground until SIGTERM/SIGINT (SIGHUP reloads the config). On exit every capability
    rolls back, except that quota's classifier stays enforcing for the next agent (see --detach-on-exit)."""
    from qosagent import logs
    from qosagent.daemon import Agent, watchdog_usec
    from qosagent.metrics import MetricsServer, health_server
    from qosagent.status import StatusServer
    from qosagent.weblisten import security

    overrides = {"listen": metrics_listen, "health_listen": health_listen, "web_config_file": web_config_file}
    try:
        cfg = config_mod.with_metrics(load_config(config_path), overrides)
    except ValueError as e:
        click.echo(f"command line: {e}", err=True)
        sys.exit(2)
    _refuse_old_kernel(cfg)
    logs.setup(cfg.log_level)
    log = logging.getLogger("qosagent.cli")
    agent = Agent(cfg, HostFS(host_root), config_path)
    agent.metrics_overrides = overrides
    agent.ctx.detach_on_exit = detach_on_exit
    agent.install_signal_handlers()
    try:
        status_server = StatusServer(agent, cfg.status.socket)
    except OSError as e:
        log.error("status socket: %s", e)
        sys.exit(1)
    agent.add_endpoint(status_server)
    status_server.start()
    if cfg.metrics.enabled:
        m = cfg.metrics
        try:
            metrics_server = MetricsServer(agent, m.listen, sec=security(m))
            health = health_server(agent, m.health_listen) if m.health_listen else None
        except OSError as e:
            log.error("metrics listen %s: %s", m.listen, e)
            agent.stop()
            sys.exit(1)
        for server in (metrics_server, health):
            if server is not None:
                agent.add_endpoint(server)
                server.start()
        log.info("metrics on %s://%s:%s/metrics", "https" if metrics_server.tls else "http",
                 *metrics_server.address[:2])
        if health is not None:
            log.info("health on http://%s:%s/healthz and /readyz", *health.address[:2])
    watchdog_us = os.environ.get("WATCHDOG_USEC", "")
    agent.unit_watchdog_us = int(watchdog_us) if watchdog_us.isdigit() else None
    widened = watchdog_usec(cfg, agent.unit_watchdog_us)
    if widened:
        sd_notify(f"WATCHDOG_USEC={widened}")
    try:
        agent.start(settle=False)
        agent.run(notify=sd_notify)
    finally:
        sd_notify("STOPPING=1")
        agent.stop()
        # Quota says itself when it hands its classifier over; an agent without quota has nothing to hand over.
        log.info("stopped; %s", "everything attached has been detached" if detach_on_exit else "rolled back")


@main.command()
@host_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--strict", is_flag=True, help="Exit 1 when an enabled capability cannot run (FOUND's warnings do not).")
@click.option("--systemd", "systemd_dropin", is_flag=True,
              help="Print the systemd drop-in that grants what this config's capabilities need beyond the shipped "
                   "unit (empty but for a comment when the unit is enough), and nothing else.")
def check(config_path: str | None, host_root: str, as_json: bool, strict: bool, systemd_dropin: bool) -> None:
    """Validate the config and report what the host offers, what the agent will use, and what it would meet there
    now (FOUND: warnings, such as serving cgroups already above a memory limit they would get). Changes nothing."""
    from qosagent import capabilities
    from qosagent.capability import State
    from qosagent import sandbox

    cfg = load_config(config_path)
    if systemd_dropin:
        click.echo(sandbox.dropin(capabilities.sandbox_needs(cfg))
                   or "# qosagent: the shipped unit grants everything this config needs.", nl=False)
        return
    _refuse_old_kernel(cfg)
    fs = HostFS(host_root)
    found = _probe_all(cfg, fs)
    failed = [n for n, v in found.verdicts.items() if v.state is State.UNAVAILABLE]
    reports = matchreport.tenant_reports(cfg)
    source = config_path or config_mod.DEFAULT_SOURCE
    click.echo(_check_json(source, found, reports) if as_json else _check_text(source, found, reports))
    if strict and failed:
        sys.exit(1)
    for svc in capabilities.services(found.enabled):
        # What the config asks of a service (tenants that match pods need a runtime to learn them from) is an
        # error here, whichever capability would use it.
        problem = svc.problem(cfg, fs)
        if problem is not None:
            click.echo(f"{source}: {problem}", err=True)
            sys.exit(1)


@dataclass(frozen=True)
class _Probed:
    """What `check` found: the host's features, each capability's verdict, and the BPF maps the usable ones make."""

    features: Any
    enabled: Any
    verdicts: dict[str, Any]
    cpus: int  # possible CPUs, what per-CPU maps are sized by
    maps: dict[str, Any]
    findings: dict[str, Any]  # capability -> what it found on the host as it is now (warnings: exit status unchanged)


def _probe_all(cfg: Any, fs: HostFS) -> _Probed:
    """Every capability probed as the agent's start would (disabled and sandbox-refused ones say so instead)."""
    from qosagent import capabilities
    from qosagent.capability import AgentContext, State, Verdict
    from qosagent.daemon import gpu_backend
    from qosagent.ebpf import mapsize
    from qosagent.features import probe
    from qosagent import sandbox
    from qosagent.services import Service

    gpu = gpu_backend(cfg)
    feats = probe(fs, f"{gpu.name}: " + (getattr(gpu, "reason", "") or f"{len(gpu.devices())} GPU(s)"))
    ctx = AgentContext(config=cfg, hostfs=fs, gpu=gpu)
    verdicts: dict[str, Verdict] = ctx.verdicts
    enabled = capabilities.enabled(cfg)
    # The services the probes start (the pods' listing threads) are stopped however the look ends: an exception
    # out of a probe, kernel_maps or findings must not leave their threads running (the process would not exit).
    try:
        for cls in capabilities.CAPABILITIES:
            if cls not in enabled:
                verdicts[cls.name] = Verdict(State.DISABLED, "disabled in config")
            elif (refused := sandbox.refusal(cls.sandbox_needs(cfg), hostfs=fs)) is not None:
                verdicts[cls.name] = Verdict(State.UNAVAILABLE, refused)
            else:
                ctx.record(cls, cls(ctx).probe(feats))
        gpu.close()
        cpus = mapsize.possible_cpus(fs)
        usable = [cls for cls in enabled if verdicts[cls.name].state in (State.ACTIVE, State.DEGRADED)]
        maps = {cls.name: m for cls in usable if (m := cls(ctx).kernel_maps(verdicts[cls.name].plan))}
        findings = {cls.name: f for cls in usable if (f := _findings(cls, ctx, verdicts[cls.name].plan))}
    finally:
        for svc in ctx.services.values():
            if isinstance(svc, Service):
                svc.stop()
    return _Probed(feats, enabled, verdicts, cpus, maps, findings)


def _findings(cls: Any, ctx: Any, plan: Any) -> list[Any]:
    from qosagent.capability import Finding

    try:
        return cls(ctx).findings(plan)
    except Exception as e:  # noqa: BLE001 - a look at the host that failed is a line, never a failed check
        return [Finding(f"could not look at the host as it is now: {type(e).__name__}: {e}", {"error": str(e)})]


def _check_json(source: str, found: _Probed, reports: Any) -> str:
    from qosagent.ebpf import mapsize

    return json.dumps({
        "config": source,
        "config_valid": True,
        "host": found.features.as_dict(),
        "capabilities": {n: v.as_dict() for n, v in found.verdicts.items()},
        "tenants": [r.as_dict() for r in reports],
        "bpf_maps": {"possible_cpus": found.cpus,
                     "bytes": {n: mapsize.total(m, found.cpus) for n, m in found.maps.items()}},
        "findings": {n: [{"text": f.text, **f.fields} for f in fs] for n, fs in found.findings.items()},
    }, indent=2)


def _check_text(source: str, found: _Probed, reports: Any) -> str:
    from qosagent.ebpf import mapsize

    lines = [f"config: {source}: valid", _render_features(found.features), "\nCAPABILITY   STATE        REASON"]
    lines += [f"{n:<12} {v.state.value:<12} {v.reason}" for n, v in found.verdicts.items()]
    if found.maps:
        lines.append(f"\nBPF MAPS     kernel memory made at start ({found.cpus} possible CPUs; docs/configuration.md)")
        lines += [mapsize.render(n, m, found.cpus) for n, m in found.maps.items()]
    if found.findings:
        lines.append("\nFOUND        what the agent would meet on this host now (warnings: exit status unchanged)")
        lines += [f"{n:<12} {f.text}" for n, fs in found.findings.items() for f in fs]
    lines.append("\n" + matchreport.render(reports))
    return "\n".join(lines)


def _render_features(f: Any) -> str:
    yn = {True: "yes", False: "no"}
    lines = [
        f"kernel {f.kernel}: BTF {yn[f.btf]}, headers {yn[f.kernel_headers]}, tracefs {f.tracefs}, "
        f"bpffs {f.bpffs}, kprobes {yn[f.kprobes]}",
        "tracepoints: " + ", ".join(f"{k} {yn[v]}" for k, v in f.tracepoints.items()),
        f"tc: clsact {yn[f.clsact]}, cls_bpf {yn[f.cls_bpf]}, tcx {yn[f.tcx]}",
        f"cgroup2: {f.cgroup2 or 'not mounted'}, sock_ops sendmsg callback {yn[f.sockops_sendmsg]}",
        "cpufreq: " + (", ".join(f"{p} {d['driver']}/{d['governor']}" for p, d in f.cpufreq.items()) or "none"),
        "thermal zones: " + (", ".join(f"{z} ({t})" for z, t in f.thermal_zones.items()) or "none"),
        "hwmon: " + (", ".join(f"{h} ({n})" for h, n in f.hwmon.items()) or "none"),
        "NUMA nodes: " + (", ".join(map(str, f.numa_nodes)) or "none"),
        "GPUs (PCI): " + (", ".join(f.pci_gpus) or "none") + f"; NVML: {f.nvml}",
    ]
    return "\n".join(lines)


@main.command()
@host_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, every tenant (or only --tenant's).")
@click.option("--decisions", is_flag=True, help="Every decision kept in the audit ring, not only the last ten.")
# 20: a node of a thousand tenants printed three thousand lines.
@click.option("--top", type=click.IntRange(min=0), default=20, show_default=True,
              help="Tenants shown: those in SLO breach first, then throttled ones, then the busiest; 0 shows all.")
@click.option("--tenant", "tenant", default=None, metavar="NAME", help="Show this tenant only.")
@click.option("--socket", "socket_path", default=None, help="Status socket (default: status.socket of the config).")
def status(config_path: str | None, host_root: str, as_json: bool, decisions: bool, top: int, tenant: str | None,
           socket_path: str | None) -> None:
    """Show the running agent's per-tenant latency, limits, capabilities and recent decisions."""
    from qosagent.status import NoAgent, ranked, render, request, select

    path = socket_path or load_config(config_path).status.socket
    try:
        st = request(path, {"cmd": "status", "decisions": decisions})
    except NoAgent as e:
        click.echo(f"qosagent: {e}", err=True)
        sys.exit(EXIT_NO_AGENT)
    if tenant is not None and tenant not in ranked(st):
        raise click.BadParameter(f"no tenant {tenant!r} in the agent's status", param_hint="--tenant")
    if as_json:
        click.echo(json.dumps(st if tenant is None else select(st, [tenant]), indent=2, default=str))
    else:
        click.echo(render(st, top, tenant))


@main.command()
@host_options
@click.option("--socket", "socket_path", default=None, help="Status socket (default: status.socket of the config).")
def reload(config_path: str | None, host_root: str, socket_path: str | None) -> None:
    """Ask the running agent to re-read its config; a bad config is refused and the old one keeps running."""
    from qosagent.status import NoAgent, request

    path = socket_path or load_config(config_path).status.socket
    try:
        resp = request(path, {"cmd": "reload"})
    except NoAgent as e:
        click.echo(f"qosagent: {e}", err=True)
        sys.exit(EXIT_NO_AGENT)
    click.echo(resp.get("message") or resp.get("error", ""))
    sys.exit(0 if resp.get("ok") else 1)


@main.command()
@host_options
def detach(config_path: str | None, host_root: str) -> None:
    """Remove everything a qosagent left on this host (filters, pins, frequency limits, affinities, cgroup values,
    thread scheduling)."""
    from qosagent.capabilities import CAPABILITIES
    from qosagent.capability import AgentContext
    from qosagent.gpu.backend import NoGpu

    cfg = load_config(config_path)
    ctx = AgentContext(config=cfg, hostfs=HostFS(host_root), gpu=NoGpu())
    removed: list[str] = []
    for cls in reversed(CAPABILITIES):
        removed += cls.detach(ctx)
    for line in removed:
        click.echo(line)
    if not removed:
        click.echo("nothing of qosagent's was found")


@main.command()
@host_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def topology(config_path: str | None, host_root: str, as_json: bool) -> None:
    """Show NUMA nodes, their CPUs and distances, and the GPUs and accelerators with the node each sits on."""
    from qosagent.daemon import gpu_backend
    from qosagent.placement.topology import read_topology, render

    cfg = load_config(config_path)
    gpu = gpu_backend(cfg)
    try:
        topo = read_topology(HostFS(host_root), gpu.devices())
    finally:
        gpu.close()
    if as_json:
        click.echo(json.dumps(topo.as_dict(), indent=2))
    else:
        click.echo(render(topo))


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), required=True,
              help="YAML config: its fleet section (engine, endpoints, prefix, intervals) and tenants' "
                   "quota.fleet_rps, as the agents have them.")
@click.option("--metrics", "listen", default="127.0.0.1:9465", show_default=True,
              help="HOST:PORT of /metrics, /readyz and /healthz (over TLS and with basic auth on /metrics as "
                   "metrics.tls, metrics.basic_auth or --web-config-file say, as the agent's).")
@listener_options
def allocator(config_path: str, listen: str, health_listen: str | None, web_config_file: str | None) -> None:
    """Split each tenant's fleet quota over the nodes that report to etcd (docs/fleet.md). Run 2-3 replicas: one
    leads (etcd election), the others stand by; SIGTERM resigns so a standby takes over within a round."""
    import signal

    from qosagent import logs
    from qosagent.fleet.allocator import Allocator, allocator_servers
    from qosagent.fleet.etcd import Etcd
    from qosagent.weblisten import security

    try:
        cfg = config_mod.with_metrics(load_config(config_path), {"health_listen": health_listen,
                                                                 "web_config_file": web_config_file})
    except ValueError as e:
        click.echo(f"command line: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    if not cfg.fleet.enabled:
        click.echo(f"{config_path}: fleet.enabled is false: nothing to allocate", err=True)
        sys.exit(EXIT_CONFIG)
    logs.setup(cfg.log_level)
    log = logging.getLogger("qosagent.allocator")
    f = cfg.fleet
    alloc = Allocator(cfg, Etcd(f.endpoints, timeout=min(1.0, f.report_interval)))
    try:
        servers = allocator_servers(alloc, listen, security(cfg.metrics), cfg.metrics.health_listen)
    except (OSError, ValueError) as e:
        log.error("metrics listen %s: %s", listen, e)
        sys.exit(1)
    for server in servers:
        server.start()
    log.info("allocator %s: %d tenant(s) with a fleet quota, etcd %s, metrics on %s://%s:%s/metrics", alloc.me,
             len(alloc.quotas), ", ".join(f.endpoints), "https" if servers[0].tls else "http",
             *servers[0].address[:2])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: alloc.stop())
    sd_notify("READY=1")
    try:
        alloc.run()
    finally:
        alloc.resign()
        for server in servers:
            server.close()
        alloc.etcd.close()
        log.info("allocator stopped")
