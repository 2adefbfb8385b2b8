"""Restarts without a gap in enforcement: a clean stop leaves the classifier and its pins enforcing, the next agent
adopts them, and a flood on an over-quota tenant never gets more than its bucket allows in any 100 ms window while
the agent restarts; an upgrade to another pin layout hands over the same way. `--detach-on-exit` and `qosagent
detach` remove everything."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from qosagent.ebpf.pins import QUOTA_LAYOUT as LAYOUT
from tests.conftest import require
from tests.integration.netlab import Lab, sh
from testkit.agent import AgentProcess, agent_argv, agent_env
from tests.integration.quota_agent import agent_of_layout, start_quota_agent

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

SERVER, FLOOD = "198.18.15.1", "198.18.15.2"
RPS, BURST = 20, 10


class Env:
    def __init__(self, lab: Lab, tmp: Path):
        self.lab, self.tmp = lab, tmp
        self.srv, self.cli = lab.netns("srv"), lab.netns("cli")
        lab.veth((self.srv, "vs", f"{SERVER}/24"), (self.cli, "vc", f"{FLOOD}/24"))
        lab.serve(self.srv, "0.0.0.0", 8000, 8100)
        self.pin_root = f"/sys/fs/bpf/qosagent-test-{lab.tag}"
        self.socket = str(tmp / "status.sock")
        self.config = tmp / "qosagent.yaml"
        self.config.write_text(yaml.safe_dump({
            "interval": "100ms", "state_dir": str(tmp), "status": {"socket": self.socket},
            "metrics": {"enabled": False}, "bpf": {"pin_root": self.pin_root},
            "latency": {"enabled": False, "ports": [8000]},
            "quota": {"enabled": True, "interfaces": ["vs", "lo"], "heartbeat_timeout": "2s"},
            "tenants": [{"name": "flood", "tier": "bronze", "match": {"ports": [8100]},
                         "quota": {"rps": RPS, "burst": BURST}}],
        }))
        self.log = tmp / "agent.log"

    def start(self, extra: tuple[str, ...] = (), layout: int | None = None) -> AgentProcess:
        argv = None if layout is None else agent_of_layout(layout, "run", "--config", str(self.config), *extra)
        agent = start_quota_agent(self.srv, self.config, self.socket, self.log, extra, argv)
        self.lab.agents.append(agent)
        return agent

    def stop(self, agent: AgentProcess) -> None:
        assert agent.stop() == 0, self.log.read_text()

    def hook(self) -> str:
        return "".join(sh("ip", "netns", "exec", self.srv, "tc", *args)
                       for args in (("qdisc", "show"), ("filter", "show", "dev", "vs", "ingress"),
                                    ("filter", "show", "dev", "lo", "ingress")))

    def flood(self, duration: float) -> subprocess.Popen:
        return self.lab.load(self.cli, SERVER, 8100, FLOOD, threads=32, duration=duration, delay=0.2, timeout=15)


@pytest.fixture
def env(root, bpf, tmp_path) -> Iterator[Env]:
    require(all(shutil.which(t) for t in ("ip", "tc", "nsenter")), "ip, tc or nsenter missing")
    lab = Lab("handover")
    try:
        e = Env(lab, tmp_path)
        yield e
    finally:
        lab.close()
        shutil.rmtree(f"/sys/fs/bpf/qosagent-test-{lab.tag}", ignore_errors=True)


def windows(done: list[tuple[float, float]], frm: float, to: float, width: float = 0.1) -> list[int]:
    """Requests served per window of `width` seconds between frm and to (by completion time)."""
    n = math.ceil((to - frm) / width)
    counts = [0] * n
    for t, _ in done:
        if frm <= t < to:
            counts[min(int((t - frm) / width), n - 1)] += 1
    return counts


def restart_under_flood(env: Env, old: subprocess.Popen, new_extra: tuple[str, ...] = ()) \
        -> tuple[subprocess.Popen, dict, float, float]:
    flood = env.flood(duration=16)
    time.sleep(3)  # the burst is spent: the bucket is empty and the flood keeps it so
    stopped = time.time()
    env.stop(old)
    # Between the two agents: no agent at all, and the filter still on both hooks.
    assert env.hook().count("qosagent-quota") == 2, env.hook()
    new = env.start(new_extra)
    ready = time.time()
    out, _ = flood.communicate(timeout=120)
    return new, json.loads(out), stopped, ready


def check_enforced(r: dict, stopped: float, ready: float) -> None:
    assert all("timed out" in e for e in r["errors"]), r["errors"]
    # The bucket's own bound in any 100 ms window: its capacity plus what refills in 100 ms. Without a classifier
    # the flood is served at hundreds per window.
    per_window = windows(r["done"], r["start"], r["end"])
    bound = BURST + math.ceil(RPS * 0.1)
    assert max(per_window) <= bound, (max(per_window), per_window)
    # Across the restart (from the stop until a second after the new agent was ready) and after it: the rate.
    span = ready + 1 - stopped
    during = sum(windows(r["done"], stopped, ready + 1))
    assert during <= RPS * span * 1.1 + BURST, (during, span)
    after = sum(windows(r["done"], r["start"] + 1, r["end"])) / (r["end"] - r["start"] - 1)
    assert RPS * 0.9 <= after <= RPS * 1.1, after
    print(f"restart took {ready - stopped:.1f}s; max {max(per_window)} per 100 ms overall, "
          f"{max(windows(r['done'], stopped, ready + 1))} across the restart (bound {bound}); "
          f"{during / span:.1f}/s across the restart; {after:.1f}/s overall")


def test_restart_under_flood_hands_over_and_detach_removes_everything(env):
    before = env.hook()
    bpffs_before = set(os.listdir("/sys/fs/bpf"))
    first = env.start()
    new, r, stopped, ready = restart_under_flood(env, first)
    assert "handover: filter on vs, lo" in env.log.read_text()
    assert env.log.read_text().count("adopted pinned quota state") == 1
    check_enforced(r, stopped, ready)
    # Still one filter per interface: replaced in place.
    assert env.hook().count("qosagent-quota") == 2
    env.stop(new)
    assert os.path.isdir(os.path.join(env.pin_root, f"quota-v{LAYOUT}"))
    # Uninstalling: detach removes what the handover left.
    out = subprocess.run(["nsenter", f"--net=/run/netns/{env.srv}", *agent_argv("detach", "--config",
                                                                                 str(env.config))],
                         env=agent_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert env.hook() == before
    assert not os.path.exists(env.pin_root)
    assert set(os.listdir("/sys/fs/bpf")) <= bpffs_before


def test_upgrade_to_another_layout_hands_over_and_detach_on_exit_removes_everything(env):
    before = env.hook()
    old = env.start(layout=LAYOUT - 1)
    assert os.listdir(env.pin_root) == [f"quota-v{LAYOUT - 1}"]
    new, r, stopped, ready = restart_under_flood(env, old, ("--detach-on-exit",))
    log = env.log.read_text()
    assert f"removed pins {env.pin_root}/quota-v{LAYOUT - 1}" in log, log
    assert "adopted pinned quota state" not in log
    check_enforced(r, stopped, ready)
    assert os.listdir(env.pin_root) == [f"quota-v{LAYOUT}"]
    env.stop(new)
    assert env.hook() == before
    assert not os.path.exists(env.pin_root)
