"""An agent taking over from one of an older pin layout (quota-v1, as a killed agent left it): the old filter is
replaced in place, the old record of a clsact we created is inherited, the old pins go; and `qosagent detach`
cleans up an older layout's leftovers on its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from qosagent.config import parse
from qosagent.ebpf import libbpf
from qosagent.ebpf.pins import QUOTA_LAYOUT as LAYOUT
from tests.conftest import netns, require
from testkit.agent import agent_argv, agent_env
from tests.integration.quota_agent import start_quota_agent
from testkit.agent import AgentProcess

pytestmark = pytest.mark.privileged

V1 = str(Path(__file__).resolve().parents[1] / "quota_v1.py")
DEFAULTS = parse({}, "defaults").quota


class Env:
    def __init__(self, ns: str, pin_root: str, tmp: Path):
        self.ns, self.pin_root, self.tmp = ns, pin_root, tmp
        self.config = tmp / "qosagent.yaml"
        self.socket = str(tmp / "status.sock")
        self.agent: AgentProcess | None = None
        self.config.write_text(yaml.safe_dump({
            "interval": "100ms",
            "state_dir": str(tmp),
            "status": {"socket": self.socket},
            "metrics": {"enabled": False},
            "bpf": {"pin_root": pin_root},
            "latency": {"enabled": False, "ports": [8000]},
            "quota": {"enabled": True, "interfaces": ["lo"]},
            "tenants": [{"name": "solo", "tier": "gold", "match": {"ports": [8100]}, "quota": {"rps": 10}}],
        }))

    def in_ns(self, *argv: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}", *argv]

    def leave_v1(self) -> int:
        out = subprocess.run(self.in_ns(sys.executable, V1, self.pin_root, str(DEFAULTS.tc_prio),
                                        str(DEFAULTS.tc_handle)), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    def hook(self) -> str:
        return "".join(subprocess.run(["tc", "-n", self.ns, *args], capture_output=True, text=True,
                                      check=True).stdout
                       for args in (("qdisc", "show", "dev", "lo"), ("filter", "show", "dev", "lo", "ingress")))

    def log(self) -> str:
        return (self.tmp / "agent.log").read_text()

    def start_agent(self) -> None:
        self.agent = start_quota_agent(self.ns, self.config, self.socket, self.tmp / "agent.log",
                                       ("--detach-on-exit",))


@pytest.fixture
def env(root, bpf, tmp_path) -> Iterator[Env]:
    require(all(shutil.which(t) for t in ("ip", "tc", "nsenter")), "ip, tc or nsenter missing")
    pin_root = f"/sys/fs/bpf/qosagent-test-{uuid.uuid4().hex[:8]}"
    with netns("quotaports") as ns:
        e = Env(ns, pin_root, tmp_path)
        try:
            yield e
        finally:
            if e.agent is not None:
                e.agent.kill()
            shutil.rmtree(pin_root, ignore_errors=True)


def test_an_older_layout_is_taken_over_in_place_then_stopped_cleanly(env):
    before = env.hook()
    old_id = env.leave_v1()
    assert "qosagent-quota" in env.hook() and "clsact" in env.hook()
    env.start_agent()
    hook = env.hook()
    fd = libbpf.obj_get(os.path.join(env.pin_root, f"quota-v{LAYOUT}", "quota_classify"))
    try:
        new_id = libbpf.prog_id(fd)
    finally:
        os.close(fd)
    assert hook.count("qosagent-quota") == 1, hook  # replaced, not a second filter
    assert f" id {new_id} " in hook and f" id {old_id} " not in hook, hook
    assert os.listdir(env.pin_root) == [f"quota-v{LAYOUT}"]
    assert f"removed pins {env.pin_root}/quota-v1" in env.log()
    # Stopping with --detach-on-exit removes the clsact too: the old agent created it, and its record was inherited.
    assert env.agent is not None
    assert env.agent.stop() == 0, env.log()
    assert env.hook() == before
    assert not os.path.exists(env.pin_root)


def test_detach_removes_what_an_older_layout_left(env):
    before = env.hook()
    env.leave_v1()
    out = subprocess.run(env.in_ns(*agent_argv("detach", "--config", str(env.config))), env=agent_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "removed filter" in out.stdout and "removed clsact qdisc on lo" in out.stdout, out.stdout
    assert env.hook() == before
    assert not os.path.exists(env.pin_root)
