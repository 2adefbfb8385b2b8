"""A fleet on one host: a hub network namespace with a real etcd and allocator replicas, and nodes, each in a
network namespace of its own reached by a veth from the hub, each with its own agent (started by `ip netns exec`,
so with its own /sys, and a bpffs mounted for it alone), state dir, pin root, status socket, server and clients.
Addresses are 198.18.<node>.0/24; close() kills what it started and deletes the namespaces (the agents' pins go
with their mount namespaces, their filters with the node namespaces)."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from qosagent.fleet import records
from tests.integration.netlab import LOAD, Lab
from testkit.agent import AgentProcess, agent_argv, agent_env, status_socket

ETCD_PORT = 2379
TENANT = "acme"


def in_ns(ns: str, *argv: str, timeout: float = 10) -> str:
    return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *argv], capture_output=True, text=True,
                          timeout=timeout).stdout


class Fleet:
    def __init__(self, tmp: Path, nodes: int, quota: float, burst: int | None = None, report_interval: float = 0.5,
                 lease: float = 2.0):
        self.tmp, self.quota, self.burst = tmp, quota, burst
        self.report_interval, self.lease = report_interval, lease
        self.lab = Lab("fleet")
        self.hub = self.lab.netns("hub")
        self.nodes = [f"node-{i}" for i in range(1, nodes + 1)]
        self.ns: dict[str, str] = {}
        self.agents: dict[str, AgentProcess] = {}
        self.loads: dict[str, list[subprocess.Popen]] = {n: [] for n in self.nodes}
        self.allocators: dict[str, subprocess.Popen] = {}
        self.etcd: subprocess.Popen | None = None
        for i, node in enumerate(self.nodes, 1):
            ns = self.ns[node] = self.lab.netns(node)
            self.lab.veth((ns, "eth0", f"198.18.{i}.2/24"), (self.hub, f"v{i}", f"198.18.{i}.1/24"))
        self.start_etcd()

    # ---- the hub -----------------------------------------------------------------------------------------
    def start_etcd(self) -> None:
        data = self.tmp / "etcd"
        peer = "http://127.0.0.1:2380"
        self.etcd = self.lab.spawn(self.hub, [
            "etcd", "--name", "hub", "--data-dir", str(data), "--listen-client-urls", f"http://0.0.0.0:{ETCD_PORT}",
            "--advertise-client-urls", f"http://127.0.0.1:{ETCD_PORT}", "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer, "--initial-cluster", f"hub={peer}", "--log-level", "warn"],
            stdout=open(self.tmp / "etcd.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if '"health":"true"' in in_ns(self.hub, "curl", "-s", f"http://127.0.0.1:{ETCD_PORT}/health"):
                return
            time.sleep(0.2)
        raise AssertionError(f"etcd not healthy in 30 s\n{(self.tmp / 'etcd.log').read_text()}")

    def stop_etcd(self) -> None:
        assert self.etcd is not None
        self.etcd.kill()
        self.etcd.wait(10)

    def config(self, node: str | None) -> dict[str, Any]:
        i = self.nodes.index(node) + 1 if node else 0
        endpoint = f"http://198.18.{i}.1:{ETCD_PORT}" if node else f"http://127.0.0.1:{ETCD_PORT}"
        state = self.tmp / (node or "allocator")
        state.mkdir(exist_ok=True)
        return {
            "interval": "200ms", "state_dir": str(state), "metrics": {"enabled": False},
            "status": {"socket": status_socket() if node else str(state / "status.sock")},
            "bpf": {"pin_root": "/sys/fs/bpf/qosagent"}, "servers": [], "gpu": {"backend": "none"},
            "latency": {"enabled": False, "ports": [8000]}, "dvfs": {"enabled": False},
            "quota": {"enabled": True, "interfaces": ["lo"], "namespaces": False},
            "fleet": {"enabled": True, "endpoints": [endpoint], "node": node or "allocator",
                      "report_interval": f"{self.report_interval}s", "lease": f"{self.lease}s",
                      "expected_nodes": len(self.nodes)},
            "tenants": [{"name": TENANT, "tier": "gold", "match": {"ports": [8000]},
                         "quota": {"fleet_rps": self.quota, "fleet_burst": self.burst}}],
        }

    def start_allocator(self, name: str) -> subprocess.Popen:
        path = self.tmp / "allocator.yaml"
        path.write_text(yaml.safe_dump(self.config(None)))
        port = 9470 + len(self.allocators)
        p = self.lab.spawn(self.hub, [*agent_argv("allocator", "--config", str(path), "--metrics",
                                                  f"127.0.0.1:{port}")],
                           env=agent_env(), stdout=open(self.tmp / f"{name}.log", "ab"), stderr=subprocess.STDOUT)
        p.port = port  # type: ignore[attr-defined]
        self.allocators[name] = p
        return p

    def allocator_metrics(self, name: str) -> dict[str, float]:
        text = in_ns(self.hub, "curl", "-s", f"http://127.0.0.1:{self.allocators[name].port}/metrics")  # type: ignore[attr-defined]
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                out[k] = float(v)
        return out

    def leader(self) -> str | None:
        for name, p in self.allocators.items():
            if p.poll() is None and self.allocator_metrics(name).get("qosagent_allocator_leader") == 1.0:
                return name
        return None

    def etcd_prefix(self, prefix: str) -> dict[str, bytes]:
        end = bytearray(prefix.encode())
        end[-1] += 1
        body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                           "range_end": base64.b64encode(bytes(end)).decode()})
        out = in_ns(self.hub, "curl", "-s", "-X", "POST", f"http://127.0.0.1:{ETCD_PORT}/v3/kv/range", "-d", body)
        kvs = json.loads(out or "{}").get("kvs") or []
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]) for kv in kvs}

    def grants(self) -> dict[str, float]:
        """node -> the tenant's rate, as the allocator last wrote them."""
        got = self.etcd_prefix("/qosagent/fleet/grants/")
        return {k.rsplit("/", 1)[-1]: records.decode_grant(v).tenants.get(TENANT, 0.0) for k, v in got.items()}

    # ---- the nodes ---------------------------------------------------------------------------------------
    def start_agents(self) -> None:
        """Every node's server and agent; the agents compile at once and are waited for together."""
        mount = 'mount -t bpf bpf /sys/fs/bpf && exec "$@"'
        for node in self.nodes:
            ns = self.ns[node]
            self.lab.serve(ns, "127.0.0.1", 8000)
            cfg = self.config(node)
            path = self.tmp / f"{node}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            a = AgentProcess(path, cfg["status"]["socket"], self.tmp / f"{node}.log",
                             prefix=["ip", "netns", "exec", ns, "sh", "-c", mount, "sh"])
            a.launch()
            self.agents[node] = a
            self.lab.agents.append(a)
        for node, a in self.agents.items():
            st = a.wait_ready()
            caps = st["capabilities"]
            if caps.get("quota", {}).get("state") != "active" or caps.get("fleet", {}).get("state") != "active":
                raise AssertionError(f"{node}: {caps}\n{a.output()}")

    def load(self, node: str, threads: int, duration: float) -> None:
        p = self.lab.spawn(self.ns[node], [sys.executable, LOAD, "load", "--host", "127.0.0.1", "--port", "8000",
                                           "--src", "127.0.0.1", "--threads", str(threads), "--duration",
                                           str(duration), "--timeout", "30"],
                           stdout=subprocess.DEVNULL)
        self.loads[node].append(p)

    def unload(self, node: str) -> None:
        for p in self.loads[node]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.loads[node] = []

    def share(self, node: str) -> dict[str, Any]:
        st = self.agents[node].status()
        return next(t for t in st["fleet"]["tenants"] if t["tenant"] == TENANT) | {
            "etcd_up": st["fleet"]["etcd_up"], "report_errors": st["fleet"]["report_errors"]}

    def admitted(self) -> dict[str, int]:
        out = {}
        for node, a in self.agents.items():
            out[node] = next(t["admitted"] for t in a.status()["quota"]["tenants"] if t["tenant"] == TENANT)
        return out

    def admitted_rate(self, seconds: float) -> tuple[float, dict[str, float]]:
        """The fleet's admitted request starts per second over the next `seconds`, and each node's."""
        a0, t0 = self.admitted(), time.monotonic()
        time.sleep(seconds)
        a1, t1 = self.admitted(), time.monotonic()
        per = {n: (a1[n] - a0[n]) / (t1 - t0) for n in self.nodes}
        return sum(per.values()), per

    def wait(self, what: str, cond: Any, timeout: float, poll: float = 0.25) -> float:
        """Seconds until cond() held; AssertionError naming what, with the logs, after timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if cond():
                return time.monotonic() - t0
            time.sleep(poll)
        raise AssertionError(f"{what}: not within {timeout:g}s; grants {self.grants()}\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            out.append(f"---- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(out)

    def close(self) -> None:
        for a in self.agents.values():
            try:
                a.stop()
            except AssertionError:
                pass
        for p in self.allocators.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.allocators.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.lab.close()
        shutil.rmtree(self.tmp / "etcd", ignore_errors=True)
