"""Plumbing for the admission integration tests: a network namespace of the test's own, the processes it starts
inside it (server, clients, agent), the agent's config and status."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from qosagent.config import load
from qosagent.ebpf.maps import Map
from qosagent.quota.datapath import pin_dir
from qosagent.quota.layout import QOS_LIMIT_OVERRIDE, QOS_LIMIT_REQ, QuotaLimit
from qosagent.status import NoAgent, request
from qosagent.tenants import tenant_id
from tests.conftest import netns
from testkit.agent import REPO, AgentProcess, agent_argv, agent_env

LOAD = str(Path(__file__).with_name("admission_load.py"))
GOLD, BRONZE = "127.0.0.2", "127.0.0.3"
SLO_MS = 100.0
# The server: 4 workers, 20 ms per request (200 requests/s at most). Alone, gold's P95 is ~26 ms; with bronze
# flooding from 32 connections it is ~180 ms.
WORKERS, SERVICE_MS = 4, 20


class Procs:
    """Processes the test started inside the namespace, each stopped by its own pid when the test ends."""

    def __init__(self, ns: str):
        self.ns = ns
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=agent_env(), **kw)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)

    def server(self, port: int) -> subprocess.Popen[bytes]:
        return self.start([sys.executable, LOAD, "server", str(port), str(WORKERS), str(SERVICE_MS)],
                          stdout=subprocess.DEVNULL)

    def client(self, port: int, src: str, threads: int, pause_ms: float, seconds: float, out: Path,
               timeout: float = 5.0, chat: tuple[int, int] | None = None) -> subprocess.Popen[bytes]:
        """chat: (words, max_tokens) makes each request a streamed chat completion timed to its first token."""
        return self.start([sys.executable, LOAD, "chat" if chat else "client", "127.0.0.1", str(port), src,
                           str(threads), str(pause_ms), str(seconds), str(timeout), str(out),
                           *map(str, chat or ())])


def results(p: subprocess.Popen[bytes], out: Path) -> list[tuple[float, float, bool]]:
    """[start (CLOCK_MONOTONIC s), latency ms, ok] per request of a finished client."""
    assert p.wait(120) == 0
    return [tuple(r) for r in json.loads(out.read_text())]  # type: ignore[misc]


def p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * 0.95))]


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the agent re-reads the fake GPU file on change: never let it see half a file


def wait_for(what: str, fn: Any, timeout: float, agent: "Agent | None" = None) -> Any:
    """With agent, a timeout says what the agent had decided and logged: a run that failed once under load kept
    neither, and its cause could not be found afterwards."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    seen = ""
    if agent is not None:
        st = agent.status()
        log = agent.log.read_text(errors="replace") if agent.log.exists() else ""
        seen = (f"\nadmission's decisions: {json.dumps(st.get('decisions', []))[-4000:]}"
                f"\nservers: {json.dumps(st.get('servers', {}))[-2000:]}\nagent log (tail):\n{log[-4000:]}")
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}{seen}")


def config(tmp: Path, port: int, pin_root: str, quota: str, admission: str, gold: str = "", bronze: str = "",
           extra: str = "", slo_ms: float = SLO_MS) -> Path:
    """Gold and bronze on one server port, told apart by client address; the fake GPU driven by tmp/gpu.json.
    gold and bronze are more keys of those tiers; extra is more top-level config ($PORT: the server's port)."""
    write_json(tmp / "gpu.json", {"preset": "single", "gpus": {"0": {"memory_used_ratio": 0.30}}})
    path = tmp / "qosagent.yaml"
    path.write_text(f"""
interval: 100ms
state_dir: {tmp / 'state'}
metrics: {{listen: "127.0.0.1:{port + 1}"}}
status: {{socket: {tmp / 'status.sock'}}}
bpf: {{pin_root: {pin_root}}}
gpu: {{backend: fake, fake_file: {tmp / 'gpu.json'}}}
tiers:
  gold:   {{slo_p99: {slo_ms:g}ms, weight: 10{", " + gold if gold else ""}}}
  bronze: {{slo_p99: 5s, weight: 1, quota: {{rps: 400, burst: 40}}{", " + bronze if bronze else ""}}}
tenants:
  - {{name: gold-app, tier: gold, match: {{cidrs: [{GOLD}/32], ports: [{port}]}}}}
  - {{name: bronze-app, tier: bronze, match: {{cidrs: [{BRONZE}/32], ports: [{port}]}}}}
latency: {{enabled: true, ports: [{port}], window: 1s}}
quota: {quota}
admission: {admission}
{extra.replace("$PORT", str(port))}
""")
    return path


def _rate(interval_ns: int, tau_ns: int) -> tuple[float, int]:
    """A GCRA bucket as (requests/s, burst), as quota.rules.bucket wrote it; tau 0 sheds every request."""
    if tau_ns == 0:
        return 0.0, 0
    return round(1e9 / interval_ns, 2), round(tau_ns / interval_ns)


def read_limits(cfg: str, tenants: list[str]) -> dict[str, dict[str, Any]]:
    """Each tenant's entry in the classifier's quota_limits map, read from its pin: the configured request limit
    and the override admission wrote (None: none in force)."""
    path = pin_dir(load(cfg))
    out: dict[str, dict[str, Any]] = {}
    with Map.pinned(os.path.join(path, "quota_slots"), ctypes.c_uint32, ctypes.c_uint32) as slots, \
            Map.pinned(os.path.join(path, "quota_limits"), ctypes.c_uint32, QuotaLimit) as limits:
        for name in tenants:
            slot = slots.lookup(tenant_id(name))
            assert slot is not None, f"{name} has no slot in the kernel"
            lim = limits.lookup(slot)
            assert lim is not None and lim.tenant == tenant_id(name)
            out[name] = {
                "baseline": _rate(lim.req.interval_ns, lim.req.tau_ns) if lim.flags & QOS_LIMIT_REQ else None,
                "override": _rate(lim.override.interval_ns, lim.override.tau_ns)
                if lim.flags & QOS_LIMIT_OVERRIDE else None,
            }
    return out


def kernel_limits(agent: "Agent", *tenants: str) -> dict[str, dict[str, Any]]:
    """read_limits as the agent's kernel holds them: the pins live in the bpffs of the agent's mount namespace
    (`ip netns exec` gives it a /sys of its own), so they are read from inside it."""
    assert agent.proc is not None
    r = subprocess.run(["nsenter", "--target", str(agent.proc.pid), "--mount", sys.executable, "-m",
                        "tests.integration.admission_harness", "limits", str(agent.config), *tenants],
                       env=agent_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {name: {k: tuple(v) if isinstance(v, list) else v for k, v in lim.items()}
            for name, lim in json.loads(r.stdout).items()}


class Agent(AgentProcess):
    """The agent inside the test's namespace (`ip netns exec`, as the servers and clients)."""

    def __init__(self, ns: str, cfg: Path, tmp: Path):
        super().__init__(cfg, str(tmp / "status.sock"), tmp / "agent.log", prefix=["ip", "netns", "exec", ns])
        self.ns = ns

    def status(self, decisions: bool = True) -> dict[str, Any]:
        """{} while it does not answer (polled by wait_for)."""
        try:
            return request(self.socket, {"cmd": "status", "decisions": decisions}, timeout=5)
        except (NoAgent, OSError):
            return {}

    def decisions(self, target: str, *actions: str) -> list[dict[str, Any]]:
        return [d for d in self.status(decisions=True).get("decisions", []) if d["capability"] == "admission"
                and d["target"] == target and (not actions or d["action"] in actions)]

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.kill()
            # Whatever a killed agent left (TC filter in the namespace, pins) goes the documented way.
            subprocess.run(["ip", "netns", "exec", self.ns, *agent_argv("detach", "--config", self.config)],
                           env=agent_env(), check=False, timeout=60, capture_output=True)


@contextlib.contextmanager
def scenario(tmp: Path, quota: str, admission: str, server: Callable[[Procs, int], Any] | None = None,
             start: bool = True, **tiers_and_extra: Any) -> Iterator[tuple[Procs, Agent, int]]:
    """The server and the agent running in a fresh namespace; everything stopped, detached and removed after.
    server(procs, port) starts another server than the worker pool; start=False leaves the agent for the test to
    start (a baseline taken without it first)."""
    port = 20000 + secrets.randbelow(20000)
    pin_root = f"/sys/fs/bpf/qosagent-test-{secrets.token_hex(4)}"
    cfg = config(tmp, port, pin_root, quota, admission, **tiers_and_extra)
    with netns("admission") as ns:
        procs = Procs(ns)
        agent = None
        try:
            (server or Procs.server)(procs, port)
            agent = Agent(ns, cfg, tmp)
            if start:
                agent.start()
            yield procs, agent, port
        finally:
            if agent is not None:
                agent.close()
            procs.stop_all()
    assert not os.path.exists(pin_root), f"{pin_root} left behind"


if __name__ == "__main__":
    if sys.argv[1:2] == ["limits"]:
        print(json.dumps(read_limits(sys.argv[2], sys.argv[3:])))
