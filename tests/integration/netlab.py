"""Network namespaces joined by veth pairs, addressed in 198.18.0.0/15 (the benchmarking range), with the processes
started in them; everything is deleted by close(), also when a test fails."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

from testkit.agent import AgentProcess

LOAD = str(Path(__file__).resolve().parents[1] / "quota_load.py")


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


class Lab:
    def __init__(self, owner: str):
        self.tag = f"{owner}-{secrets.token_hex(3)}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.agents: list[AgentProcess] = []

    def netns(self, role: str) -> str:
        name = f"qa-{self.tag}-{role}"
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def veth(self, a: tuple[str, str, str | None], b: tuple[str, str, str | None]) -> None:
        """A veth pair between (netns, device, address/prefix or None) a and b, both ends up."""
        (ns_a, dev_a, _), (ns_b, dev_b, _) = a, b
        sh("ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, addr in (a, b):
            if addr:
                sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")

    def spawn(self, ns: str, argv: list[str], **kw: object) -> subprocess.Popen:
        """A process in ns by nsenter (ip netns exec would remount /sys and hide the host's bpffs)."""
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", *argv], **kw)  # type: ignore[call-overload]
        self.procs.append(p)
        return p

    def serve(self, ns: str, addr: str, *ports: int) -> subprocess.Popen:
        p = self.spawn(ns, [sys.executable, LOAD, "serve", addr, *map(str, ports)], stdout=subprocess.PIPE,
                       text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    def load(self, ns: str, host: str, port: int, src: str, threads: int, duration: float, delay: float = 0.5,
             pause: float = 0.0, timeout: float = 30.0, requests: int = 100000) -> subprocess.Popen:
        """Client threads from src, each sending up to `requests` requests (quota_load.py's JSON on stdout)."""
        return self.spawn(ns, [sys.executable, LOAD, "load", "--host", host, "--port", str(port), "--src", src,
                               "--threads", str(threads), "--duration", str(duration), "--delay", str(delay),
                               "--pause", str(pause), "--timeout", str(timeout), "--max-requests", str(requests)],
                          stdout=subprocess.PIPE, text=True)

    def delete(self, ns: str) -> None:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.remove(ns)

    def close(self) -> None:
        for a in self.agents:
            a.kill()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for ns in list(self.namespaces):
            self.delete(ns)
