"""Quota's namespace follow at rest and when a pod comes and goes, counted: the agent (quota alone, its filter on lo)
runs in a "node" namespace of the test's; each follow the test asks for is quota's maintain with its once-a-second
cadence made due. With no link leading into another namespace a follow scans no /proc and asks the kernel nothing
(a netlink notification would tell it of a new link); a pod's veth and server are followed at the next follow; a
gone pod is forgotten, and the follow is back at rest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from typing import Iterator

import pytest

from tests.conftest import require
from tests.integration.netlab import Lab, sh

pytestmark = [pytest.mark.privileged]

POD, NODE = "198.18.5.1", "198.18.5.254"

CHILD = r"""
import collections, json, logging, sys
from qosagent import netns
from qosagent.config import parse
from qosagent.daemon import Agent
from qosagent.hostfs import HostFS

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
cfg = parse({"interval": "100ms", "metrics": {"enabled": False}, "bpf": {"pin_root": sys.argv[1]},
             "latency": {"enabled": False}, "servers": [], "quota": {"enabled": True, "interfaces": ["lo"]},
             "tenants": [{"name": "pod", "tier": "gold", "match": {"process": "quota_load", "ports": [8000]},
                          "quota": {"rps": 100, "burst": 10}}]}, "test")
agent = Agent(cfg, HostFS("/"), None)
agent.ctx.detach_on_exit = True
agent.start()
quota = next(c for c in agent.capabilities if c.name == "quota")
assert agent.verdicts["quota"].state.value == "active", agent.verdicts
count = collections.Counter()

def counted(obj, attr, key):
    f = getattr(obj, attr)
    def w(*a, **k):
        count[key] += 1
        return f(*a, **k)
    setattr(obj, attr, w)

counted(netns, "serving_namespaces", "proc scans")
counted(quota.ctx.service(netns.Follower), "current", "namespaces asked")
ipr = quota.datapath.netlink().ipr
for m in ("get_links", "link_lookup", "get_netnsid", "tc", "get_filters"):
    counted(ipr, m, "netlink requests")
print("ready", flush=True)
try:
    for line in sys.stdin:
        count.clear()
        for _ in range(int(line)):
            quota.namespaces.every.again()
            quota.maintain()
        print(json.dumps({"count": count, "namespaces": quota.namespaces.shown}), flush=True)
finally:
    agent.stop()
"""


class Node:
    def __init__(self, lab: Lab, pin_root: str):
        self.lab, self.pin_root = lab, pin_root
        self.ns = lab.netns("node")
        self.agent = lab.spawn(self.ns, [sys.executable, "-c", CHILD, pin_root], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        assert self.agent.stdout is not None and self.agent.stdout.readline().strip() == "ready"

    def follow(self, n: int) -> dict:
        assert self.agent.stdin is not None and self.agent.stdout is not None
        self.agent.stdin.write(f"{n}\n")
        self.agent.stdin.flush()
        line = self.agent.stdout.readline()
        assert line, "the agent child exited"
        return json.loads(line)


@pytest.fixture
def node(root, bpf) -> Iterator[Node]:
    require(all(shutil.which(t) for t in ("ip", "tc", "nsenter")), "ip, tc or nsenter missing")
    lab = Lab("follow")
    pin_root = f"/sys/fs/bpf/qosagent-test-{lab.tag}"
    try:
        yield Node(lab, pin_root)
    finally:
        lab.close()
        shutil.rmtree(pin_root, ignore_errors=True)


def test_a_follow_at_rest_costs_no_scan_and_no_netlink_request_and_a_pod_is_still_followed(node: Node) -> None:
    rest = node.follow(5)
    assert rest == {"count": {}, "namespaces": []}, rest

    # A pod: its veth into the node, its server on the tenant's port.
    pod = node.lab.netns("pod")
    node.lab.veth((node.ns, "pa", f"{NODE}/24"), (pod, "eth0", f"{POD}/24"))
    server = node.lab.serve(pod, POD, 8000)
    got = node.follow(1)
    (shown,) = got["namespaces"]
    assert shown["egress"] == ["pa"] and shown["ports"] == [8000] and shown["tenants"] == {"8000": "pod"}, got
    assert got["count"]["proc scans"] == 1, got
    assert "qosagent-quota" in sh("ip", "netns", "exec", node.ns, "tc", "filter", "show", "dev", "pa", "egress")

    # While a link leads into another namespace, every follow asks for the serving namespaces (scanned once a second:
    # a process there may start serving any time).
    assert node.follow(3)["count"]["namespaces asked"] == 3

    server.kill()
    server.wait(10)
    node.lab.delete(pod)  # its veth goes with it, once the kernel has cleaned the namespace up
    got = node.follow(1)
    assert got["namespaces"] == [], got
    deadline = time.monotonic() + 10
    while subprocess.run(["ip", "-n", node.ns, "link", "show", "pa"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the pod's veth outlived its namespace"
        time.sleep(0.05)
    node.follow(2)  # the link gone announced: listed again, at this follow and the next (Links.poll)
    rest = node.follow(5)
    assert rest == {"count": {}, "namespaces": []}, rest
    assert node.agent.stdin is not None
    node.agent.stdin.close()
    assert node.agent.wait(30) == 0
