"""Cgroups of a test's own for the resources tests: per controller where this host has each (one hierarchy on a
unified host, one per controller on a hybrid one), and servers started in them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Iterable, Iterator

from qosagent.cgroups import V2
from qosagent.hostfs import HostFS
from qosagent.resources.discovery import Layout
from tests.conftest import require
from testkit.agent import agent_env

HOST = HostFS("/")

# A stand-in serving process: listens on its port, three idle threads, one more on "spawn"; touches `mib` MiB.
SERVER = r"""
import socket, sys, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
buf = bytearray(int(sys.argv[2]) << 20)
for i in range(0, len(buf), 4096):
    buf[i] = 1
print("ready", flush=True)
for line in sys.stdin:
    threading.Thread(target=stop.wait, daemon=True).start()
    print("spawned", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in(ns: str, argv: list[str], cgroup_procs: Iterable[str] = (), cpu: int | None = None,
           **kw: Any) -> subprocess.Popen[bytes]:
    """argv in network namespace `ns` (its cgroup and bpffs mounts the host's), entered into the cgroups whose
    cgroup.procs files are given and pinned to `cpu` before it runs."""
    procs = list(dict.fromkeys(cgroup_procs))

    def enter() -> None:
        for f in procs:
            with open(f, "w") as out:
                out.write(str(os.getpid()))
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", *argv], env=agent_env(), preexec_fn=enter, **kw)


class Lab:
    """Cgroups of the test's own (per controller, where this host has each) and servers started in them."""

    def __init__(self) -> None:
        self.layout = Layout.probe(HOST)
        self.token = f"qa-resources-{uuid.uuid4().hex[:8]}"
        self.dirs: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []

    def dir(self, controller: str, path: str) -> str:
        version = self.layout.versions[controller]
        return f"/sys/fs/cgroup{path}" if version == V2 else f"/sys/fs/cgroup/{controller}{path}"

    def cgroup(self, name: str) -> str:
        """A cgroup /<token>/<name> in every hierarchy of cpu and memory (one on a unified host)."""
        top, path = f"/{self.token}", f"/{self.token}/{name}"
        for c in ("cpu", "memory"):
            for d in (self.dir(c, top), self.dir(c, path)):
                if not os.path.isdir(d):
                    os.mkdir(d)
                    self.dirs.append(d)
            if self.layout.versions[c] == V2:
                # The root's too: a pure-v2 guest without systemd enables no controller for its children.
                for parent in (self.dir(c, ""), self.dir(c, top)):
                    with open(f"{parent}/cgroup.subtree_control", "w") as f:
                        f.write(f"+{c}")
        return path

    def serve(self, port: int, path: str | None, mib: int = 1) -> subprocess.Popen[str]:
        procs = [f"{self.dir(c, path)}/cgroup.procs" for c in ("cpu", "memory")] if path else []

        def enter() -> None:
            for f in dict.fromkeys(procs):
                with open(f, "w") as out:
                    out.write(str(os.getpid()))

        p = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(mib), self.token], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, preexec_fn=enter)
        self.procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    def read(self, controller: str, path: str, file: str) -> str:
        with open(f"{self.dir(controller, path)}/{file}") as f:
            return f.read().strip()

    def files(self, path: str) -> dict[str, str]:
        names = {V2: ("cpu.max", "cpu.weight", "memory.min", "memory.high", "memory.max"),
                 "v1": ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.shares", "memory.soft_limit_in_bytes",
                        "memory.limit_in_bytes")}
        out = {}
        for c in ("cpu", "memory"):
            for f in names[self.layout.versions[c] or "v1"]:
                if f.startswith(c):
                    out[f] = self.read(c, path, f)
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for d in reversed(self.dirs):
            self._kill_members(d)
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.1)  # a killed child leaves its cgroup a moment after wait()


    @staticmethod
    def _kill_members(directory: str) -> None:
        """Whatever still runs in a cgroup of ours (a server's forked workers outlive its killed parent)."""
        try:
            with open(f"{directory}/cgroup.procs") as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def cgroup_lab() -> Iterator[Lab]:
    layout = Layout.probe(HOST)
    require(all(layout.versions.values()), f"cpu and memory controllers mounted (found {dict(layout.versions)})")
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()
