from __future__ import annotations

import json
import subprocess

import pytest

from testkit.agent import agent_argv, agent_env


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(agent_argv(*args), env=agent_env(), capture_output=True, text=True, timeout=timeout)


def test_bad_config_exits_2_naming_file_and_key(tmp_path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tenants:\n  - name: acme\n    tier: platinum\n    match: {ports: [18001]}\n")
    r = run_cli("check", "--config", str(cfg))
    assert r.returncode == 2
    assert f"{cfg}: tenants[0].tier: unknown tier 'platinum'" in r.stderr


def test_check_reports_fixture_host_as_json(node_exporter_sysfs) -> None:
    r = run_cli("check", "--json", "--host-root", str(node_exporter_sysfs))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["config_valid"] is True
    assert report["host"]["numa_nodes"] == [0, 1, 2]
    assert report["host"]["thermal_zones"] == {"thermal_zone0": "cpu-thermal"}
    assert report["host"]["hwmon"]["hwmon0"] == "coretemp"
    assert set(report["capabilities"]) == {"latency", "quota", "servers", "resources", "admission", "fleet", "dvfs",
                                         "placement"}
    assert report["capabilities"]["quota"]["state"] == "disabled"


def test_check_strict_fails_when_an_enabled_capability_cannot_run(tmp_path) -> None:
    # An empty host root has no BTF and no tracepoints: latency, enabled by default, cannot run there.
    r = run_cli("check", "--strict", "--host-root", str(tmp_path))
    assert r.returncode == 1
    assert "latency" in r.stdout and "unavailable" in r.stdout


def test_status_without_agent_is_one_line_and_exit_3(tmp_path) -> None:
    r = run_cli("status", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 3
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no agent running" in r.stderr


def test_reload_without_agent_exits_3(tmp_path) -> None:
    assert run_cli("reload", "--socket", str(tmp_path / "none.sock")).returncode == 3


def test_every_command_takes_host_root() -> None:
    for cmd in ("run", "check", "status", "reload", "detach"):
        r = run_cli(cmd, "--help")
        assert "--host-root" in r.stdout, cmd


def test_check_says_what_the_tiers_ask_beyond_the_node(tmp_path) -> None:
    """A guarantee or a CPU bound larger than the node: resources is degraded, each key named, and check exits 0
    (the agent runs and sets what it can)."""
    host = tmp_path / "host"
    for path, text in {"sys/devices/system/cpu/online": "0-1\n", "proc/meminfo": "MemTotal: 4194304 kB\n",
                       "sys/fs/cgroup/cgroup.controllers": "cpu memory\n"}.items():
        (host / path).parent.mkdir(parents=True, exist_ok=True)
        (host / path).write_text(text)
    cfg = tmp_path / "qosagent.yaml"
    cfg.write_text("tiers:\n  gold: {slo_p99: 120ms, weight: 10, resources: {cpus: 8, memory: 8GiB}}\n"
                   "tenants: [{name: acme, tier: gold, match: {ports: [8000]}}]\nresources: {enabled: true}\n")
    r = run_cli("check", "--json", "--config", str(cfg), "--host-root", str(host))
    assert r.returncode == 0, r.stderr
    verdict = json.loads(r.stdout)["capabilities"]["resources"]
    assert verdict["state"] == "degraded", verdict
    assert "tiers.gold.resources.cpus 8 is more than the node's 2 online CPUs" in verdict["reason"], verdict
    assert "tiers.gold.resources.memory 8GiB is more than the node's memory (4.0GiB)" in verdict["reason"], verdict


def test_check_stops_the_services_its_probes_started_when_the_look_fails(monkeypatch, node_exporter_sysfs) -> None:
    """`qosagent check`'s look at the host (cli._probe_all): a service a probe started (the pods' listing threads) is
    stopped even when kernel_maps or findings raise, so the process does not hang on its threads."""
    from qosagent import capabilities, cli
    from qosagent.capability import State, Verdict
    from qosagent.config import parse
    from qosagent.hostfs import HostFS
    from qosagent.services import Service

    stopped: list[str] = []

    class Listing(Service):
        name = "test-listing"

        def stop(self) -> None:
            stopped.append(self.name)

    class Failing:
        name, offers = "failing", ()

        def __init__(self, ctx) -> None:
            self.ctx = ctx

        @staticmethod
        def sandbox_needs(_cfg) -> list:
            return []

        def probe(self, _feats) -> Verdict:
            self.ctx.services[Listing.name] = Listing()
            return Verdict(State.ACTIVE, "probed")

        def kernel_maps(self, _plan) -> list:
            raise RuntimeError("kernel_maps failed")

    monkeypatch.setattr(capabilities, "CAPABILITIES", (Failing,))
    monkeypatch.setattr(capabilities, "enabled", lambda _cfg: [Failing])
    with pytest.raises(RuntimeError, match="kernel_maps failed"):
        cli._probe_all(parse({}, "t"), HostFS(str(node_exporter_sysfs)))
    assert stopped == ["test-listing"]
