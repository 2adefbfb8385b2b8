"""The agent without a compiler: BCC compiles in a child that pins what it loaded and exits, the agent opens the
pins (qosagent/ebpf/pinned.py). Its memory holds no LLVM; a restart with the same source and settings opens the
kept build instead of compiling; a changed setting, or pins that are not what their manifest says, make a new
build; a compile child killed half-way leaves nothing and the agent says why the capability is unavailable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from qosagent.ebpf.libbpf import map_create, obj_get, obj_pin
from qosagent.ebpf.pins import quota_dir
from tests.conftest import require
from tests.integration.latency_helpers import until
from tests.integration.netlab import Lab
from testkit.agent import READY_S, AgentProcess, agent_argv, agent_env

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

COMPILER = ("libLLVM", "libclang", "libbcc")


class Env:
    def __init__(self, lab: Lab, tmp: Path):
        self.lab, self.tmp = lab, tmp
        self.ns, self.cli = lab.netns("srv"), lab.netns("cli")
        lab.veth((self.ns, "vs", "198.18.25.1/24"), (self.cli, "vc", "198.18.25.2/24"))
        self.pin_root = f"/sys/fs/bpf/qosagent-test-{lab.tag}"
        self.socket = str(tmp / "status.sock")
        self.config = tmp / "qosagent.yaml"
        self.log = tmp / "agent.log"
        self.write()

    def write(self, latency: bool = False, header_scan_bytes: int | None = None, runq: bool = False,
              window: str = "10s", read_server: bool = False) -> None:
        """read_server: the agent reads the server's metrics on its API port, as on a vLLM host (gold then matches by
        its client's address, so the reads are no tenant's)."""
        quota: dict = {"enabled": True, "interfaces": ["vs"]}
        if header_scan_bytes is not None:
            quota["header_scan_bytes"] = header_scan_bytes
        gold: dict = {"ports": [8000], "cidrs": ["198.18.25.2/32"]} if read_server else {"ports": [8000]}
        servers = {"servers": [{"port": 8000, "metrics": "http://198.18.25.1:8000/metrics"}]} if read_server else {}
        self.config.write_text(yaml.safe_dump({
            **servers,
            "interval": "100ms", "state_dir": str(self.tmp), "status": {"socket": self.socket},
            "metrics": {"enabled": False}, "bpf": {"pin_root": self.pin_root},
            "latency": {"enabled": latency, "ports": [8000], "runqueue": {"enabled": runq}, "window": window},
            "admission": {"enabled": latency},
            "quota": quota,
            "tenants": [{"name": "gold", "tier": "gold", "match": gold,
                         "quota": {"rps": 100, "burst": 10}}],
        }))

    def agent(self) -> AgentProcess:
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the host's bpffs.
        a = AgentProcess(self.config, self.socket, self.log, prefix=["nsenter", f"--net=/run/netns/{self.ns}"])
        self.lab.agents.append(a)
        return a

    def builds(self, name: str = "quota") -> list[str]:
        d = quota_dir(self.pin_root) if name == "quota" else self.pin_root
        return sorted(n for n in os.listdir(d) if n.startswith(f"{name}-")) if os.path.isdir(d) else []


@pytest.fixture
def env(root, bpf, tmp_path) -> Iterator[Env]:
    require(all(shutil.which(t) for t in ("ip", "tc", "nsenter")), "ip, tc or nsenter missing")
    lab = Lab("lean")
    try:
        yield Env(lab, tmp_path)
    finally:
        lab.close()
        shutil.rmtree(f"/sys/fs/bpf/qosagent-test-{lab.tag}", ignore_errors=True)


def mapped(pid: int) -> set[str]:
    """The files mapped into a process."""
    out = set()
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "-" in parts[0] and parts[5].startswith("/"):
                out.add(parts[5])
    return out


def memlock(build: str) -> int:
    """The kernel memory of the maps pinned in a build, as the kernel accounts it."""
    total = 0
    for name in os.listdir(build):
        fd = obj_get(os.path.join(build, name))
        try:
            info = dict(line.split(":", 1) for line in open(f"/proc/self/fdinfo/{fd}").read().splitlines())
        finally:
            os.close(fd)
        if "map_type" in info and name != "manifest":
            total += int(info["memlock"])
    return total


def children(pid: int) -> list[int]:
    return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def states(st: dict) -> dict[str, tuple[str, str]]:
    return {k: (v.get("state"), v.get("reason", "")) for k, v in st["capabilities"].items()}


def test_no_compiler_in_the_agent(env: Env) -> None:
    """With latency, quota and admission running, nothing of LLVM, clang or BCC is mapped into the agent, and its
    compile children are gone."""
    env.write(latency=True)
    agent = env.agent()
    st = agent.start()
    assert states(st)["quota"][0] == "active", st["capabilities"]
    assert states(st)["latency"][0] in ("active", "degraded"), st["capabilities"]
    assert agent.proc is not None
    files = mapped(agent.proc.pid)
    assert any("libbpf" in f for f in files), sorted(files)  # the maps are read through it: the check sees libraries
    assert not [f for f in files if any(c in f for c in COMPILER)], sorted(files)
    assert children(agent.proc.pid) == []
    # What `qosagent check` says the maps take is what the kernel accounts for them (memlock of each map pinned in
    # the builds), within a quarter.
    out = subprocess.run(["nsenter", f"--net=/run/netns/{env.ns}", *agent_argv("check", "--json", "--config",
                                                                               str(env.config))],
                         env=agent_env(), capture_output=True, text=True, timeout=120, check=True).stdout
    said = json.loads(out)["bpf_maps"]["bytes"]
    for name, d in (("quota", quota_dir(env.pin_root)), ("latency", env.pin_root)):
        [build] = env.builds(name)
        real = memlock(os.path.join(d, build))
        assert 0.8 < said[name] / real < 1.25, (name, said[name], real)
    assert agent.stop() == 0, agent.output()


def test_restart_opens_the_kept_builds_and_a_change_recompiles(env: Env) -> None:
    """A restart with nothing changed opens the builds the last agent kept, quota's and latency's; a changed
    compile-time setting makes a new build of what it changes and the old one goes."""
    env.write(latency=True)
    agent = env.agent()
    agent.start()
    first = {n: env.builds(n) for n in ("quota", "latency")}
    assert all(len(b) == 1 for b in first.values()), first
    assert agent.stop() == 0
    mark = len(agent.output())
    agent = env.agent()
    st = agent.start()
    assert states(st)["latency"][0] in ("active", "degraded"), st["capabilities"]
    out = agent.output()[mark:]
    assert {n: env.builds(n) for n in first} == first
    assert "opened the kept quota build" in out and "opened the kept latency build" in out, out
    assert "in a compile child" not in out, out
    assert agent.stop() == 0
    env.write(latency=True, header_scan_bytes=256)
    agent = env.agent()
    agent.start()
    assert env.builds("quota") not in ([], first["quota"]) and env.builds("latency") == first["latency"]
    assert agent.stop() == 0
    env.write(latency=True, header_scan_bytes=256, runq=True)
    agent = env.agent()
    agent.start()
    assert env.builds("latency") not in ([], first["latency"])
    assert agent.stop() == 0


def test_foreign_or_corrupted_pins_are_replaced(env: Env) -> None:
    """A build whose map pin was swapped for another map, or whose manifest is gone, is never opened: the next
    agent builds again, in the same place (same source and settings), and enforces."""
    agent = env.agent()
    agent.start()
    assert agent.stop() == 0
    [build] = env.builds()
    path = os.path.join(quota_dir(env.pin_root), build)
    # A foreign map where the classifier's limits were: same name, another shape.
    os.unlink(os.path.join(path, "quota_limits"))
    fd = map_create(2, "foreign", 4, 8, 1)
    try:
        obj_pin(fd, os.path.join(path, "quota_limits"))
    finally:
        os.close(fd)
    agent = env.agent()
    st = agent.start()
    assert states(st)["quota"][0] == "active", st["capabilities"]
    out = agent.output()
    assert "not reusing the quota build" in out and "quota_limits" in out, out
    assert env.builds() == [build]
    assert agent.stop() == 0
    os.unlink(os.path.join(path, "manifest"))
    log_before = len(agent.output())
    agent = env.agent()
    st = agent.start()
    assert states(st)["quota"][0] == "active", st["capabilities"]
    assert "no readable manifest" in agent.output()[log_before:]
    assert os.path.exists(os.path.join(path, "manifest"))
    assert agent.stop() == 0


def compile_children(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        try:
            if b"qosagent.ebpf.compile" in open(f"/proc/{child}/cmdline", "rb").read():
                out.append(child)
        except FileNotFoundError:
            pass
    return out


def test_latency_builds_beside_quota(env: Env) -> None:
    """A cold start with quota and latency: latency's compile child, begun before the first capability starts,
    runs beside quota's where there are two CPUs; both builds are opened."""
    require(len(os.sched_getaffinity(0)) >= 2, "one CPU: the builds run one after the other")
    env.write(latency=True)
    agent = env.agent()
    agent.launch()
    assert agent.proc is not None
    most = 0
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline and "ready in" not in agent.output():
        most = max(most, len(compile_children(agent.proc.pid)))
        time.sleep(0.02)
    st = agent.wait_ready()
    assert states(st)["quota"][0] == "active" and states(st)["latency"][0] == "active", st["capabilities"]
    assert most == 2, agent.output()
    out = agent.output()
    assert "built quota in a compile child" in out and "built latency in a compile child" in out, out
    assert agent.stop() == 0


def test_killed_compile_child_leaves_nothing(env: Env) -> None:
    """kill -9 of each compile child (latency's, begun ahead, and quota's): the agent runs on with both
    unavailable, saying so, and no pin of a half-made build is left."""
    env.write(latency=True)
    agent = env.agent()
    agent.launch()
    assert agent.proc is not None
    seen: dict[int, float] = {}
    killed: set[int] = set()
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline and "ready in" not in agent.output():
        now = time.monotonic()
        for child in compile_children(agent.proc.pid):
            seen.setdefault(child, now)
            if child not in killed and now - seen[child] > 0.3:  # into its compile
                os.kill(child, signal.SIGKILL)
                killed.add(child)
        time.sleep(0.02)
    assert len(killed) == 2, agent.output()
    st = agent.wait_ready()
    for name in ("quota", "latency"):
        state, reason = states(st)[name]
        assert state == "unavailable" and "killed by signal 9" in reason, st["capabilities"]
    d = quota_dir(env.pin_root)
    assert not os.path.exists(d) or os.listdir(d) == [], os.listdir(d)
    assert env.builds("latency") == [], env.builds("latency")
    assert agent.stop() == 0


def _resting(agent: AgentProcess, want: bool, timeout: float) -> bool:
    return until(lambda: agent.status()["self"]["resting"], lambda r: r is want, timeout) is want


def test_an_idle_agent_rests_and_the_first_request_wakes_it(env: Env) -> None:
    """Quota, latency and admission on, no tenant's traffic: every capability says its ticks find nothing new, so
    the loop ticks every rest_interval (500 ms), though the agent reads the server's metrics on its API port every
    second (requests no tenant claims, counted by quota and timed by latency as unmatched); the first request of a
    tenant ends the rest at the next tick, and the rest comes back once its latency has left the window (2 s here:
    a window still turning over is news to admission)."""
    env.write(latency=True, window="2s", read_server=True)
    env.lab.serve(env.ns, "198.18.25.1", 8000)
    agent = env.agent()
    agent.launch()
    st = agent.wait_ready()
    assert {k: v[0] for k, v in states(st).items() if k in ("quota", "latency", "admission")} == \
        {"quota": "active", "latency": "active", "admission": "active"}, st["capabilities"]
    assert st["rest_interval_s"] == 0.5
    assert st["servers"]["servers"][0]["port"] == 8000, st["servers"]
    # Settled: the first second's rates (each window's first turn) moved rows once after ready.
    assert _resting(agent, True, 10.0), agent.output()
    time.sleep(1.5)
    assert _resting(agent, True, 10.0), agent.output()
    before = agent.status()["self"]["ticks"]
    resting = []
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        me = agent.status()["self"]
        resting.append((me["resting"], tuple(me["awake_by"])))
        time.sleep(0.05)
    ticks = agent.status()["self"]["ticks"] - before
    # At rest for 2 s: about four ticks, where the interval would have run twenty.
    woke = [r for r in resting if r != (True, ())]
    assert not woke and ticks <= 8, (ticks, woke)
    # The agent's reads of the server went on meanwhile, and reached it as requests no tenant claims.
    rows = {t["tenant"]: t for t in agent.status()["latency"]["tenants"]}
    assert rows["unmatched"]["requests"] >= 2 and rows["gold"]["requests"] == 0, rows
    load = env.lab.load(env.cli, "198.18.25.1", 8000, "198.18.25.2", threads=1, duration=0.2, requests=1)
    assert _resting(agent, False, 5.0), "the tick after the request is awake"
    load.communicate(timeout=30)
    assert _resting(agent, True, 10.0), agent.status()["self"]["awake_by"]
    assert agent.stop() == 0
